"""The tile a decode-shaped kernel runs, chosen by timing every candidate the way a decode step runs it.

Triton's autotuner times eager launches one at a time. For kernels of 2-5 µs the launch overhead and its
noise decide the pick, and processes pick differently: a SmolLM2-shaped decode step replayed a fifth faster
with the tiles chosen here than with the autotuner's.
Timing graph replays of one launch instead keeps the weights in the L2 cache, which a decode step, streaming
every layer's weights once, never has; that moved picks to tiles that lost end to end.

Here each candidate is captured in a CUDA graph as back-to-back launches, each over its own copy of the
weights, with enough copies to outgrow twice the L2 cache: consecutive kernels with no host work between
them, every one reading its weights from device memory, as in a step. The candidate whose median replay is
shortest wins, and the pick is kept for the process. During a graph capture nothing can be timed: the first
candidate runs and nothing is kept (the engine's warm-up runs every shape eagerly before it captures).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from eyas.kernels.graph_capture import capture  # warms up (compiles) on a side stream, then captures

MAX_COPIES = 256    # weight copies per timing graph (small weights need many to outgrow the L2 cache)
REPLAYS = 5         # timed replays per candidate; the median counts

_picked: dict[tuple, object] = {}


def copies_for(weight_bytes: int, l2_bytes: int) -> int:
    """Launches per timing graph: enough distinct weight copies for twice the L2 cache, 2 to MAX_COPIES."""
    return max(2, min(MAX_COPIES, math.ceil(2 * l2_bytes / max(weight_bytes, 1))))


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and clones of it, copies_for the GPU's L2 cache in all: calls that each read their own copy read
    it from device memory, as a decode step does."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    return [weight] + [weight.clone() for _ in range(copies_for(weight.numel() * weight.element_size(), l2) - 1)]


def fastest(candidates: Sequence, times: Sequence[float]):
    """The candidate with the least time (the earliest of equals); a candidate that failed has time inf."""
    if not candidates or len(times) != len(candidates):
        raise ValueError(f"{len(candidates)} candidates, {len(times)} times")
    best = min(range(len(candidates)), key=lambda i: (times[i], i))
    if math.isinf(times[best]):
        raise RuntimeError("no tile ran: every candidate failed to compile or launch")
    return candidates[best]


def choose(key: tuple, candidates: Callable[[], Sequence], launch: Callable, weight: torch.Tensor,
           timer: Callable | None = None):
    """The tile for `key`: kept from an earlier call, else the only one of candidates(), or the fastest as
    `timer` (graph_times) measures them. launch(candidate, weight) launches the kernel once with that tile.
    A kept pick costs one dict lookup: eager launches pay this on every call."""
    got = _picked.get(key)
    if got is not None:
        return got
    candidates = candidates()
    if len(candidates) == 1:
        pick = candidates[0]
    elif weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return candidates[0]
    else:
        pick = fastest(candidates, (timer or graph_times)(candidates, launch, weight))
    _picked[key] = pick
    return pick


def launch_chosen(kernel, key: tuple, candidates: Callable[[], Sequence], args: Sequence, weight_at: int,
                  grid: Callable, timer: Callable | None = None, **meta):
    """Launch the Triton `kernel` over `args` with the tile chosen for `key` (choose), where args[weight_at]
    is the weight that timing replaces by its copies and grid(tile) the launch grid of a tile."""
    def run(tile, weight):
        call = list(args)
        call[weight_at] = weight
        kernel[grid(tile)](*call, **tile.kwargs, num_warps=tile.num_warps, num_stages=tile.num_stages, **meta)

    run(choose(key, candidates, run, args[weight_at], timer), args[weight_at])


def picked(match: Callable[[tuple], bool]) -> list:
    """(key, tile) of every pick kept so far whose key `match` accepts (for reports)."""
    return [(k, v) for k, v in _picked.items() if match(k)]


def graph_times(candidates: Sequence, launch: Callable, weight: torch.Tensor) -> list[float]:
    """µs per launch of each candidate, over distinct weight copies, from CUDA-graph replays."""
    copies = weight_copies(weight)
    times = []
    for c in candidates:
        try:
            times.append(_replay_us(lambda w, c=c: launch(c, w), copies))
        except Exception:  # e.g. a tile past the registers or shared memory of this GPU: it is not a candidate
            times.append(math.inf)
    del copies
    return times


def _replay_us(run: Callable, copies: list[torch.Tensor]) -> float:
    graph, _ = capture(lambda: [run(w) for w in copies], None, attempts=1)  # a tile that fails is no candidate
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(copies))
    del graph
    return sorted(samples)[len(samples) // 2]
