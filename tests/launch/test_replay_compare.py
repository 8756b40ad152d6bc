"""The replay verdict: which result changes fail it, and which are only shown."""

from eyas.ledger.replay import compare

BEFORE = {"output_tok_s": 94.0, "accept_length": 2.6, "tpot_ms_mean": 10.0, "tpot_ms_p99": 12.0, "errors": 0,
          "completed": 80, "server_pid": 123, "accept_source": "usage"}


def verdicts(after, threshold=0.1):
    return {c.metric: c.verdict for c in compare(BEFORE, after, threshold)}


def test_within_threshold_passes_and_noise_metrics_are_not_gated():
    v = verdicts({**BEFORE, "output_tok_s": 86.0, "tpot_ms_mean": 10.9, "tpot_ms_p99": 40.0, "server_pid": 9})
    assert set(v.values()) <= {"ok", "info"} and v["tpot_ms_p99"] == "info"
    assert "server_pid" not in v and "accept_source" not in v


def test_the_lost_94_tok_s_fails():
    v = verdicts({**BEFORE, "output_tok_s": 61.7, "tpot_ms_mean": 16.0})
    assert v["output_tok_s"] == "WORSE" and v["tpot_ms_mean"] == "WORSE"


def test_errors_and_missing_metrics_fail():
    assert verdicts({**BEFORE, "errors": 1})["errors"] == "WORSE"
    assert verdicts({k: v for k, v in BEFORE.items() if k != "accept_length"})["accept_length"] == "WORSE"
    assert verdicts({**BEFORE, "output_tok_s": 200.0}, threshold=0.0)["output_tok_s"] == "ok"  # better is fine
