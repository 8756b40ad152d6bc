"""bench_adaptive_plain refuses bad arguments, and a machine without CUDA, in one line before any work."""

from pathlib import Path

import pytest

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_adaptive_plain.py"


@pytest.mark.parametrize("args", [["--tokens", "8"], ["--rounds", "0"], ["--device", "tpu"], ["--model", "/nonexistent"], []])
def test_refuses_in_one_line(args):
    import torch

    if not args and torch.cuda.is_available():
        pytest.skip("the no-CUDA refusal needs a machine without CUDA")
    got = run_script(SCRIPT, *args)
    assert got.returncode != 0
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_adaptive_plain:")


def test_measures_every_engine_on_the_cpu(tmp_path):
    import json

    from tests.helpers import tiny_llama

    tiny_llama(tmp_path / "tiny", vocab=128, layers=3, hidden=64)
    out = tmp_path / "out.json"
    got = run_script(SCRIPT, "--device", "cpu", "--model", tmp_path / "tiny", "--tokens", "16", "--rounds", "2",
                     "--top", "5", "--out", out)
    assert got.returncode == 0, got.stderr
    result = json.loads(out.read_text())
    assert set(result["engines"]) == {"plain", "spec_forced_plain", "adaptive", "spec_forced_chain"}
    for row in result["engines"].values():
        assert len(row["rounds_tok_s"]) == 2 and all(v > 0 for v in row["rounds_tok_s"])
        assert row["profile"]["steps"] > 0 and len(row["profile"]["top"]) == 5
    assert result["engines"]["plain"]["over_plain"] == 1.0
    assert "1/plain" in result["adaptive_policy"]["rates"] or "1/spec" in result["adaptive_policy"]["rates"]
