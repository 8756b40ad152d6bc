"""The tile choice's logic on the CPU (its CUDA-graph timing runs on GPUs only: tests/kernels/test_fused_linear.py)."""

import math

import pytest
import torch

from eyas.kernels import tile_choice


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(tile_choice, "_picked", {})


def test_copies_outgrow_twice_the_l2_cache():
    l2 = 50 * 2 ** 20
    assert copies_times_bytes(3_538_944, l2) >= 2 * l2  # SmolLM2's gate/up, bf16
    assert tile_choice.copies_for(663_552, l2) == 159    # its o projection: 159 x 0.66 MB > 100 MB
    assert tile_choice.copies_for(10 ** 9, l2) == 2      # larger than the cache: still two launches back to back
    assert tile_choice.copies_for(1, l2) == tile_choice.MAX_COPIES


def copies_times_bytes(weight_bytes, l2):
    return tile_choice.copies_for(weight_bytes, l2) * weight_bytes


def test_fastest_takes_the_least_time_and_the_earliest_of_equals():
    assert tile_choice.fastest(["a", "b", "c"], [3.0, 1.5, 1.5]) == "b"
    assert tile_choice.fastest(["a", "b"], [math.inf, 2.0]) == "b"
    with pytest.raises(RuntimeError, match="no tile ran"):
        tile_choice.fastest(["a", "b"], [math.inf, math.inf])
    with pytest.raises(ValueError):
        tile_choice.fastest(["a", "b"], [1.0])


def test_choose_times_once_per_key_and_keeps_the_pick():
    calls = []

    def timer(candidates, launch, weight):
        calls.append(list(candidates))
        return [2.0, 1.0, 3.0]

    w = torch.zeros(4)
    listed = []

    def candidates():
        listed.append(1)
        return ["a", "b", "c"]

    assert tile_choice.choose(("k", 1), candidates, None, w, timer) == "b"
    assert tile_choice.choose(("k", 1), candidates, None, w, timer) == "b"
    assert calls == [["a", "b", "c"]] and len(listed) == 1  # a kept pick lists no candidates again
    assert tile_choice.choose(("k", 2), lambda: ["x"], None, w, timer) == "x"  # one candidate: nothing to time
    assert len(calls) == 1
    assert tile_choice.picked(lambda key: key[0] == "k") == [(("k", 1), "b"), (("k", 2), "x")]


def test_launch_chosen_times_over_weight_copies_then_launches_the_pick_over_the_weight():
    """launch_chosen: the timer's launches pass each tile and a copy in the weight's place, and the one real
    launch runs the chosen tile over the weight itself, on that tile's grid, with the tile's settings."""
    from types import SimpleNamespace

    launches = []

    class Kernel:  # what kernel[grid](*args, **meta) does, recorded
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, args, meta))

    tiles = [SimpleNamespace(kwargs={"BLOCK_N": n}, num_warps=4, num_stages=1) for n in (2, 8)]
    weight, copy = torch.zeros(3), torch.ones(3)

    def timer(candidates, launch, w):
        for tile in candidates:
            launch(tile, copy)
        return [5.0, 1.0]

    tile_choice.launch_chosen(Kernel(), ("k", 3), lambda: tiles, ["x", weight, "y"], 1,
                              lambda tile: (16 // tile.kwargs["BLOCK_N"],), timer, USE_PDL=2)
    assert [grid for grid, _, _ in launches] == [(8,), (2,), (2,)]
    assert all(args[1] is copy for _, args, _ in launches[:2]) and launches[2][1] == ("x", weight, "y")
    assert launches[2][2] == {"BLOCK_N": 8, "num_warps": 4, "num_stages": 1, "USE_PDL": 2}
