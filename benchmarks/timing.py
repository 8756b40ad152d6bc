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


def kernels_by_name(kernels, reps: int) -> list[dict]:
    """Profiler kernel events per name (its first 80 characters): launches and µs per rep (per call of the
    profiled function, per cycle, ...), the most time first."""
    by_name: dict[str, list] = {}
    for e in kernels:
        row = by_name.setdefault(e.name[:80], [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
    return [dict(name=k, calls=n / reps, us=round(us / reps, 1))
            for k, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]


def kernel_table(fn, reps: int = 10, top: int = 12) -> dict:
    """GPU kernels of one call of `fn` under torch.profiler: count, busy time, and the kernels that take
    the most time (name, calls and microseconds per call of `fn`)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(kernels=len(kernels) / reps, gpu_busy_us=sum(e.time_range.elapsed_us() for e in kernels) / reps,
                top=kernels_by_name(kernels, reps)[:top])
