"""vocab_coverage: a vocabulary's coverage of the target's evaluation replies, by size and source, on a tiny
chat model; bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script
from tests.server.tiny import tiny_chat_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vocab_coverage.py"


def test_coverage_by_size_and_source(tmp_path):
    target = tiny_chat_model(tmp_path / "target")
    data = tmp_path / "convs.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Tell me about topic {i} and its history, please."},
                               {"from": "gpt", "value": f"Topic {i} is a thing with a long history of words."}]}
            for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cov.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(target), "--conversations", str(data),
                        "--prompts", "2", "--new-tokens", "12", "--sizes", "8,64,512", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["conversations"] == 6 and r["evaluation_replies"] == 2 and r["evaluation_tokens"] > 2
    by = {(x["size"], x["source"]): x for x in r["rows"]}
    assert len(by) == 6
    for source in ("assistant", "assistant+user"):
        cov = [by[(n, source)]["evaluation_coverage"] for n in (8, 64, 512)]
        assert all(0.0 <= c <= 1.0 for c in cov) and cov == sorted(cov)
        assert cov[-1] == 1.0  # the whole vocabulary covers everything
    for n in (8, 64):  # chosen by assistant counts, a vocabulary covers the training replies at least as well
        assert by[(n, "assistant")]["training_reply_coverage"] >= by[(n, "assistant+user")]["training_reply_coverage"]


def test_bad_input_is_one_line(tmp_path):
    for args, code in ((("--sizes", "8,x"), 2), (("--model", str(tmp_path / "none")), 1)):
        p = run_script(SCRIPT, "--conversations", str(tmp_path / "missing.jsonl"), *args)
        assert p.returncode == code and p.stderr.startswith("vocab_coverage: error:"), p.stderr
        assert p.stderr.count("\n") == 1, p.stderr
