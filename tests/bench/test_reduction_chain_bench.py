"""bench_reduction_chain needs a GPU: without one, and on bad input, it says so in one line and exits 2."""

from pathlib import Path

import pytest
import torch

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_reduction_chain.py"


@pytest.mark.parametrize("args", [["--blocks", "a"], ["--blocks", "300"], ["--chain", "0"], ["--warps", "0"]])
def test_bad_input_is_one_line_and_exit_2(args):
    p = run_script(SCRIPT, *args)
    assert p.returncode == 2, (args, p.stderr)
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_reduction_chain: error:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer of a machine without a GPU")
def test_without_a_gpu_it_says_so():
    p = run_script(SCRIPT, "--chain", "2")
    assert p.returncode == 2 and "GPU" in p.stderr and p.stderr.strip().count("\n") == 0
