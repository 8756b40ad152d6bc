"""Capture a function into a CUDA graph: warm up on a side stream, then record, retrying an invalidated capture.

It lives with the kernels because the tile timing (tile_choice) captures its candidates too; the engine's
graphs (eyas.engine.graphs) import it from here, so the import arrows keep pointing down.
"""

from __future__ import annotations

import gc
import sys

import torch

CAPTURE_ATTEMPTS = 2  # captures of one graph before its error is raised


def capture(fn, pool, attempts: int = CAPTURE_ATTEMPTS):
    """Warm `fn` up on a side stream (allocator, lazily built kernels), then capture it; returns (graph, outputs).

    A capture the driver invalidates (cudaErrorStreamCaptureInvalidated: some call that a capture forbids ran
    meanwhile) leaves no graph but no damage either: it is warmed up and captured again, up to `attempts`
    times in all, with a line on stderr each time; then the error is raised. Such failures are rare and
    transient: they come from other work in the same process, not from `fn`. The garbage collector is off
    during a capture: a collection there would free tensors of finished requests (CUDA or pinned host memory,
    whose allocators query and record events), work that a capture may forbid (torch.cuda.graph collects
    before it starts, not during)."""
    for attempt in range(1, attempts + 1):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool):
                outputs = fn()
            return graph, outputs
        except RuntimeError as e:  # torch.AcceleratorError and Triton's launch errors are RuntimeErrors
            if attempt == attempts or "capture" not in str(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"eyas: a CUDA graph capture failed ({first}); capturing it again", file=sys.stderr, flush=True)
        finally:
            if collecting:
                gc.enable()
