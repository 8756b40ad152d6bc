"""bench_prefill times both prefill paths and says which one the runner's rule picks; bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_prefill.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_both_paths_are_timed_and_the_rule_is_reported(tmp_path):
    out = tmp_path / "prefill.json"
    p = run("--shape", "tiny", "--device", "cpu", "--rows", "1,2", "--tokens", "64,100", "--reps", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["tokens"]) for r in results] == [(1, 64), (1, 100), (2, 64), (2, 100)]
    for r in results:
        assert r["eager_ms"] > 0 and r["chunked_ms"] > 0
        assert r["rule"] == "eager"  # no CUDA graphs on the CPU: the rule never chunks there
        assert r["faster"] == ("chunked" if r["chunked_ms"] < r["eager_ms"] else "eager")
    assert "the rule picks the faster path in" in p.stdout


def test_bad_input_is_one_line_and_exit_2():
    cases = (["--shape", "huge"], ["--rows", "a"], ["--tokens", "0"])
    # The first case as a real process (the script's own exit), the others in this one (no torch import each).
    runs = [run(*cases[0])] + [run_script(SCRIPT, *args) for args in cases[1:]]
    for args, p in zip(cases, runs):
        assert p.returncode == 2
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_prefill: error:")
