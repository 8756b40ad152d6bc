"""bench_poll_burst runs its producer and consumers through the step's own poll (Triton's interpreter on the
CPU) and checks what they read; bad input is one line."""

import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_poll_burst.py"


def test_consumers_read_the_launchs_words_on_the_cpu():
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--words", "8,600", "--programs", "3",
                        "--launches", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[:3] for r in rows] == [["| 8", "3", "2"], ["| 600", "3", "2"]]


def test_bad_input_is_one_line_and_exit_2():
    for args in (["--words", "a"], ["--programs", "0"], ["--launches", "0"]):
        p = run_script(SCRIPT, "--device", "cpu", *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_poll_burst: error:")
