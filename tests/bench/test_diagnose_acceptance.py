"""diagnose_acceptance: the acceptance replayed on its teacher-forced pass equals the Engine's on the same replies;
conversations are scored as written; the breakdown covers every chain start; bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnose_acceptance.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_simulated_acceptance_equals_the_engines_on_mt_bench(pair, tmp_path):
    target, draft = pair
    out = tmp_path / "acc.json"
    p = run("--model", str(target), "--draft", str(draft), "--prompts", "3", "--new-tokens", "24", "--device", "cpu",
            "--accuracy-steps", "4", "--out", str(out))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["texts"] == 3 and r["engine"]["passes"] > 0
    assert r["simulated_accept_length"] == r["engine"]["accept_length"] > 1.0
    assert r["simulated_accept_length_vocabulary_oracle"] >= r["simulated_accept_length"]
    assert len(r["accuracy_k"]) == 4 and r["accuracy_k"][0] == 1.0  # the pair's first guess is always right
    assert r["all"]["step0_hit_rate"] == 1.0 and r["all"]["chains"] > 0
    chains = lambda part: 0 if r[part] is None else r[part]["chains"]  # noqa: E731
    assert chains("repeat") + chains("fresh") == r["all"]["chains"]
    assert sum(v["chains"] for v in r["by_reply_position"].values() if v) == r["all"]["chains"]
    assert len(r["per_text_accept_length"]) == 3 and all(a >= 1.0 for a in r["per_text_accept_length"])
    shares = r["per_text_outside_vocabulary_share"]
    assert len(shares) == 3 and all(0.0 <= x <= 1.0 for x in shares)
    counts = [n for _, n in r["outside_vocabulary_top"]]
    assert counts == sorted(counts, reverse=True) and sum(counts) <= r["reply_tokens"] + 3
    assert (sum(counts) == 0) == (max(shares) == 0.0)


def test_conversations_are_scored_as_written(pair, tmp_path):
    target, draft = pair
    data = tmp_path / "convs.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}?"},
                               {"from": "gpt", "value": "An answer that the draft has to guess, word by word."}]}
            for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = run("--model", str(target), "--draft", str(draft), "--conversations", str(data), "--prompts", "4",
            "--device", "cpu")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["texts"] == 4 and r["engine"] is None and r["reply_tokens"] > 4 * 5
    assert all(0.0 <= a <= 1.0 for a in r["accuracy_k"]) and r["simulated_accept_length"] >= 1.0


def test_bad_input_is_one_line(pair, tmp_path):
    target, draft = pair
    p = run("--prompts", "0", "--device", "cpu")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert p.stderr.startswith("diagnose_acceptance: error:")
    p = run_script(SCRIPT, "--model", target, "--draft", draft, "--conversations", tmp_path / "missing.jsonl",
                   "--device", "cpu")  # in this process: no second torch import
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr
    assert p.stderr.startswith("diagnose_acceptance: error:")


def test_the_vocabulary_oracle_fills_in_exactly_the_tokens_outside_the_vocabulary():
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("diagnose_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    t2d = torch.ones(12, dtype=torch.bool)
    t2d[8] = t2d[10] = False                     # tokens 8 and 10 lie outside the draft vocabulary
    preds = torch.zeros(2, 6, dtype=torch.long)  # every guess wrong (token 0)
    out = module.oracle_predictions(preds, ids, t2d)
    # step k's guess at index t answers x_{t+2+k}: step 0 answers 7, 8, 9, 10 at t = 0..3; step 1 8, 9, 10 at 0..2
    assert out.tolist() == [[0, 8, 0, 10, 0, 0], [8, 0, 10, 0, 0, 0]]
    assert preds.abs().sum() == 0  # the input is left as it was
    covered = t2d.clone()
    covered[8] = True                            # a larger vocabulary that holds 8 but not 10
    assert module.oracle_predictions(preds, ids, t2d, covered).tolist() == [[0, 8, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0]]
