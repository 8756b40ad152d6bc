"""bench_persistent refuses bad arguments before it builds anything: exit 2 and the reason."""

from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_persistent.py"


def test_bad_arguments_exit_2_with_the_reason():
    cases = {("--device", "cpu", "--dtype", "bf16"): "fp32 only", ("--tiles", "1,2"): "five positive integers",
             ("--tiles", "engine;a"): "'engine' or", ("--rows", "9"): "1 to 8 rows",
             ("--dtype", "fp16"): "invalid choice", ("--warps", "four"): "'engine' or comma-separated"}
    for args, reason in cases.items():
        p = run_script(SCRIPT, *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip().splitlines()[-1].startswith("bench_persistent.py: error:"), (args, p.stderr)
        assert reason in p.stderr, (args, p.stderr)
