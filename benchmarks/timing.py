"""Median time of a callable in ms: CUDA events on the GPU (warm-up first), the host clock elsewhere."""

import time

import torch


def median_ms(fn, reps: int = 30, warmup: int = 3, cuda: bool | None = None) -> float:
    for _ in range(warmup):
        fn()
    if not (torch.cuda.is_available() if cuda is None else cuda):
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        return (time.perf_counter() - t0) / warmup * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
