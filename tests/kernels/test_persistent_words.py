"""The persistent step's polls compiled for sm_90 offline (tests/kernels/poll_ptx.py): a poll of a tensor small
enough that Triton reduces it within each warp decides each round by a vote of all the program's threads, and
only such a poll does; the Triton behaviour that rule rests on (at most 32 values are reduced without a
shared-memory stage, so each warp from its own copies); and the check that finds such a poll in a kernel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.kernels.persistent_words import WARP_REDUCED


@pytest.fixture(scope="module")
def ptx():
    script = Path(__file__).with_name("poll_ptx.py")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "0"})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.parametrize("n", [8, 32, 64, 512])
def test_a_reduction_of_at_most_32_values_stays_in_each_warp(ptx, n):
    seen = ptx[f"reduce {n}"]
    assert seen["bar.sync"] == seen["st.shared"] == (n > WARP_REDUCED), (n, seen)


@pytest.mark.parametrize("sizes, votes", [("512,8", True), ("32,64", True), ("64,64", False), ("512,128", False),
                                          ("512,64,16", True), ("64,64,64", False)])
def test_a_poll_votes_where_a_tensor_is_reduced_within_each_warp(ptx, sizes, votes):
    seen = ptx[f"poll {sizes}"]
    assert seen["bar.red.or.pred"] == votes, (sizes, seen)
    assert seen["nanosleep"] == (sizes.count(",") == 2)  # only the three-tensor case naps; the vote keeps it
    assert seen["split polls"] == 0, (sizes, seen)


@pytest.mark.parametrize("n, split", [(32, 1), (64, 0)])
def test_the_split_poll_count_finds_an_unvoted_warp_local_exit(ptx, n, split):
    """persistent_registers' count of polls that can split the warps (the sm_90 compile test asserts 0 for the
    kernel) counts a loop that exits on its own reduction of 32 values, not one of 64."""
    assert ptx[f"unvoted {n}"]["split polls"] == split, ptx[f"unvoted {n}"]
