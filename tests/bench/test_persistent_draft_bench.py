"""bench_persistent_draft runs a draft step both ways on the CPU (Triton's interpreter) and says whether they
agree; bad input is one line."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_script

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]' brings it)")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_persistent_draft.py"


def test_both_draft_steps_agree_and_are_timed_on_the_cpu():
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--draft", "random", "--context",
                        "8", "--tiles", "engine;4,16,32,16,32"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("argmax equal True") == 2 and p.stdout.count("counters complete True") == 2, p.stdout
    rows = [line.split(" | ") for line in p.stdout.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 2 and rows[1][1] == "4,16,32,16,32", rows  # the engine's tiles, then the given set
    assert all(float(x.rstrip(" |x")) > 0 for r in rows for x in r[2:]), rows


def test_bad_input_is_one_line_and_exit_2():
    for args in (["--context", "a"], ["--context", "0"], ["--reps", "0"], ["--tiles", "1,2"], ["--tiles", "a"],
                 ["--tiny"], ["--draft", "/nonexistent"], ["--device", "cpu", "--trace", "--draft", "random"]):
        p = run_script(SCRIPT, *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_persistent_draft: error:")
