"""`eyas tune`'s answer: a speculative setting slower than the plain baseline is never called the best."""

from eyas.ledger.tune import Row, best, verdict


def rows(*tok_s):
    base = Row("config", None, "1-x", "ok", output_tok_s=tok_s[0])
    return [base] + [Row("config", (s, 1, s + 1), f"{i}-x", "ok", output_tok_s=v, accept_length=1.5)
                     for i, (s, v) in enumerate(zip((1, 2, 3), tok_s[1:]), 2)]


def test_a_setting_slower_than_the_baseline_is_not_the_best():
    top, base = best(rows(88.0, 80.0, 86.5))
    text = verdict(top, base)
    assert text.startswith("best: the baseline without speculation, 88.0 tok/s (run 1-x); no setting beat it")
    assert "the fastest was steps 2, topk 1, draft tokens 3" in text and "-1.7%" in text


def test_a_faster_setting_is_the_best_with_its_margin():
    top, base = best(rows(88.0, 80.0, 94.0))
    assert verdict(top, base).startswith("best: steps 2, topk 1, draft tokens 3 (env set config): 94.0 tok/s")
    assert "+6.8% over the baseline 88.0 tok/s" in verdict(top, base)
    assert "no baseline finished" in verdict(top, None)
