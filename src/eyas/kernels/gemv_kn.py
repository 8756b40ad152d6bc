"""y = x @ wt for a few rows x [M, K] and a weight stored input-major, wt [K, N]: a GEMV whose threads each
own output columns and add along K without talking to each other until the end.

A decode step of a large model streams its weights once, so each projection should read them at the memory's
bandwidth. For an 8B model at batch 1, cuBLAS reads the [N, K] weights of q/k/v, o and down at 2.3-3.3 TB/s
against a copy bandwidth of 4.25 (docs/BENCHMARKS.md, twenty-sixth session), and our [N, K] tiles, which
reduce each chunk across threads, did no better. With the weight stored [K, N], a program takes BLOCK_N
adjacent columns (one contiguous run of bytes per input feature), multiplies BLOCK_K input features at a time
into a [BLOCK_M, BLOCK_K, BLOCK_N] accumulator elementwise, and reduces it once at the end.

A projection of few columns has too few column blocks to fill the GPU, so the K axis is split in SPLIT parts
(a launch argument): each program writes its fp32 partial sums to a workspace, and the last of a column
block's programs to finish (a ticket counter per block, taken after a release fence) adds the SPLIT partials
in a fixed order, so the result does not depend on which program finished last, writes y and resets its
counter for the next launch (CUDA-graph replays included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kn_kernel(x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, K_SPLIT, SPLIT,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_idx = k0 + ks
        k_ok = k_idx < k_hi
        w = tl.load(w_ptr + k_idx.to(tl.int64)[:, None] * N + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + rows[:, None] * K + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    part = tl.sum(acc, axis=1)
    out = rows[:, None] * N + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + out, part.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(part_ptr + pid_k * M * N + out, part, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the column block's last program: add the partials in order 0..SPLIT-1
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT):
                total += tl.load(part_ptr + s * M * N + out, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out, total.to(y_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(split: int, m: int, n: int, blocks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial sums and zeroed ticket counters for one shape, kept for the process (a graph replays them).
    Launches of one shape share them, so they must not run concurrently on two streams."""
    key = (split, m, n, blocks, str(device))
    if key not in _workspaces:
        _workspaces[key] = (torch.empty((split, m, n), dtype=torch.float32, device=device),
                            torch.zeros((blocks,), dtype=torch.int32, device=device))
    return _workspaces[key]


def gemv_kn(x: torch.Tensor, wt: torch.Tensor, block_n: int = 256, block_k: int = 16, split: int = 1,
            num_warps: int = 4) -> torch.Tensor:
    """x [..., K] @ wt [K, N] -> [..., N] in x's dtype, fp32 accumulation; split divides K among programs."""
    k = x.shape[-1]
    if wt.dim() != 2 or wt.shape[0] != k or wt.dtype != x.dtype:
        raise ValueError(f"gemv_kn: weight {tuple(wt.shape)} {wt.dtype} does not take x {tuple(x.shape)} {x.dtype}")
    if split < 1:
        raise ValueError(f"gemv_kn: split must be at least 1, got {split}")
    xr = x.reshape(-1, k).contiguous()
    m, n = xr.shape[0], wt.shape[1]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_split)
    blocks = triton.cdiv(n, block_n)
    part, tickets = _workspace(split, m, n, blocks, x.device) if split > 1 else (y, y)
    _gemv_kn_kernel[(blocks, split)](xr, wt.contiguous(), y, part, tickets, m, n, k, k_split, split,
                                     BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
                                     num_warps=num_warps)
    return y.view(*x.shape[:-1], n)
