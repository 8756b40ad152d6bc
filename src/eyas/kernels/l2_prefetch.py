"""Prefetch a weight into the GPU's L2 cache, so that the projection reading it next finds it there.

At batch 1 a decode step reads every weight once, and only the projections keep the memory busy: while
attention, the norms or the activation run, memory bandwidth goes unused. A prefetch launched beside those
kernels (on a side stream, eyas.layers.prefetch) spends that idle bandwidth on the next projection's weight.

Two ways to ask, both Hopper (sm_90) PTX and neither returning data to the SM:
- "bulk": one `cp.async.bulk.prefetch.L2` per CHUNK bytes; the copy engine does the reading.
- "lines": one `prefetch.global.L2::evict_last` per 128-byte line from every thread.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LINE = 128          # bytes per L2 line
MODES = ("bulk", "lines")


@triton.jit
def _bulk_kernel(base_ptr, nbytes, scratch_ptr, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    chunk = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    last = (nbytes - 1) // CHUNK
    chunk = tl.minimum(chunk, last)  # the grid's spare lanes repeat the last chunk
    start = chunk.to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    addr = (base_ptr + start).to(tl.int64)
    done = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                                     "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(scratch_ptr + tl.arange(0, PER_PROGRAM), done, mask=done != 0)  # never stores: keeps the asm


@triton.jit
def _lines_kernel(base_ptr, nbytes, scratch_ptr, LINES_PER_PROGRAM: tl.constexpr):
    line = tl.program_id(0).to(tl.int64) * LINES_PER_PROGRAM + tl.arange(0, LINES_PER_PROGRAM)
    start = tl.minimum(line * 128, nbytes - 1)
    addr = (base_ptr + start).to(tl.int64)
    done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                     "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(scratch_ptr + tl.arange(0, LINES_PER_PROGRAM), done, mask=done != 0)


@functools.lru_cache(maxsize=None)
def _scratch(device: torch.device) -> torch.Tensor:
    return torch.zeros(4096, dtype=torch.int32, device=device)


def chunks(nbytes: int, chunk: int) -> int:
    """How many prefetches of `chunk` bytes cover `nbytes` (the bulk copy takes multiples of 16 bytes)."""
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"an L2 prefetch chunk is a positive multiple of 16 bytes, not {chunk}")
    return -(-nbytes // chunk)


def prefetch_l2(weight: torch.Tensor, nbytes: int | None = None, mode: str = "bulk", chunk: int = 32768):
    """Ask for the first `nbytes` (default all) of contiguous `weight` to be brought into L2. Returns at once;
    the reads happen on the current stream's time, and nothing is written."""
    if mode not in MODES:
        raise ValueError(f"L2 prefetch mode {mode!r} is not one of {', '.join(MODES)}")
    if not weight.is_contiguous():
        raise ValueError("prefetch_l2 reads a contiguous weight")
    total = weight.numel() * weight.element_size()
    nbytes = total if nbytes is None else min(nbytes, total)
    nbytes -= nbytes % 16
    if nbytes <= 0:
        return
    flat = weight.view(-1).view(torch.uint8)
    scratch = _scratch(weight.device)
    if mode == "bulk":
        per_program = 32
        grid = (-(-chunks(nbytes, chunk) // per_program),)
        _bulk_kernel[grid](flat, nbytes, scratch, CHUNK=chunk, PER_PROGRAM=per_program, num_warps=1)
    else:
        per_program = 1024
        grid = (-(-chunks(nbytes, LINE) // per_program),)
        _lines_kernel[grid](flat, nbytes, scratch, LINES_PER_PROGRAM=per_program, num_warps=4)
