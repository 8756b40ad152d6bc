"""bench_serve_start's bad input is one line and exit 2, before any server starts (a timed start costs a CPU
server launch, ~7-18 s, which the suite's budget does not have; the script's numbers are in BENCHMARKS.md)."""

from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve_start.py"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = {("--model", str(tmp_path / "nope")): "not found",
             ("--model", str(tmp_path), "--rounds", "0"): "at least 1",
             ("--model", str(tmp_path), "--trees", "old"): "NAME=SRC_DIR",
             ("--model", str(tmp_path), "--trees", f"old={tmp_path}"): "no eyas/cli.py"}
    for args, needle in cases.items():
        p = run_script(SCRIPT, *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_serve_start: error:"), p.stderr
        assert needle in p.stderr, (args, p.stderr)
