"""Programmatic dependent launch (PDL): a decode kernel may start while the kernel before it finishes.

Usage: kernel[grid](..., **pdl_args(x))
       # in the kernel: <loads of weights>; wait_for_previous(USE_PDL); <the rest>

At batch 1 a decode step is a row of ~180 small kernels, and much of each one's time is its launch and
ramp. On Hopper (compute capability 9.0) and later, a kernel launched with `launch_pdl` may start once every
program of the kernel before it has executed `gdc_launch_dependents` (or ended). It must call `gdc_wait`,
which returns when that kernel has ended and its writes are visible, before it reads what any earlier kernel
wrote and before it writes anything at all (the caching allocator may hand it a buffer that an earlier
kernel still reads). Before the wait it may only read what no kernel writes: weights and norm gains. The
fused projections load their weight tile before they wait, so that load overlaps the previous kernel.
Launches captured in a CUDA graph keep these programmatic edges. A kernel that follows a cuBLAS or torch
kernel (which never signal) starts when that kernel ends, as before.

Our kernels signal once their own wait has returned, so that one kernel at most waits ahead of the one
running: signalling as they start instead let a row of waiting kernels hold SM room and weight tiles, and
replayed SmolLM2's decode step 11% slower (bench_step_ab.py side by side; docs/kernels.md).

It is on for CUDA devices of compute capability 9.0 and up; the plan's pdl=False (eyas.execution_plan) switches
it off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from eyas import execution_plan


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    """sm_90 or later, and a Triton that has the grid dependency control (3.3 and later)."""
    has_gdc = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
    return has_gdc and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL: a CUDA device of sm_90 or later, unless the plan's pdl is
    False."""
    if not execution_plan.current().pdl or not x.is_cuda:
        return False
    return _capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


OFF, ON = 0, 1  # USE_PDL: no PDL; wait for the previous kernel, then signal the next


def pdl_args(x: torch.Tensor) -> dict:
    """A decode kernel's launch keywords for x's device: its USE_PDL meta-parameter (OFF or ON) and, when on,
    Triton's launch_pdl option (never when off: Triton's interpreter takes no such option)."""
    if not pdl_on(x):
        return {"USE_PDL": OFF}
    return {"USE_PDL": ON, "launch_pdl": True}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Block until the previous kernel has ended and its writes are visible, then let the next kernel launch."""
    if USE_PDL != 0:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
