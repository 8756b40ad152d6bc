"""bench_vocab_count: the two ways of counting agree (the script refuses to report otherwise), and it writes
what it timed."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vocab_count.py"


def test_both_ways_count_the_same_and_are_timed(tmp_path):
    out = tmp_path / "vc.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--samples", "300", "--procs", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["way"], r["procs"]) for r in rows] == [("per_sample", 2), ("count_tokens", 2)]
    assert len({r["sha256"] for r in rows}) == 1 and all(r["total"] > 0 for r in rows)
    assert [len(r["seconds"]) for r in rows] == [2, 2]
    assert "| 2 |" in run.stdout


def test_bad_arguments_are_one_line():
    run = run_script(SCRIPT, "--procs", "0")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:")
