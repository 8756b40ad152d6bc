"""The k largest entries of short rows (a draft vocabulary, a tree's candidate pool), in one launch.

torch.topk on a few rows of a few thousand entries runs a radix select in one block per row, tens of µs each:
a tree's cycle calls it ten times, over the draft's log-probs and its candidate pools. Here one program holds
a whole row in registers and takes its maximum k times, each time setting the one it took aside: k block
reductions, a few µs in all for k up to MAX_K.

With LOG_SOFTMAX the values are those of log_softmax(row) (the row's maximum and sum of exponentials
reduced first, in fp32): the draft's tree steps rank its children by log-probability, which this way needs
neither a log-softmax kernel nor the [rows, V] tensor it writes. On a GPU Triton's exp and log are the fast
approximate ones, a few fp32 ulps from torch's; the values only rank draft candidates, so this moves which
of two near-tied candidates is drafted, never which tokens are accepted. log(sum) is clamped at 0 (the sum is
at least 1), so no log-probability comes out positive and a child never outranks its parent.

Ties go to the lower index, as torch.argmax's; NaN counts as the largest value, as in torch.topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16          # the most entries taken per row (the loop is unrolled)
MAX_WIDTH = 16384   # the widest row held in registers


@triton.jit
def _topk_kernel(x_ptr, val_ptr, idx_ptr, V, K: tl.constexpr, BLOCK: tl.constexpr, LOG_SOFTMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(x_ptr + row * V + cols, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: the largest
    if LOG_SOFTMAX:
        top = tl.max(x, 0)
        log_sum = tl.maximum(tl.log(tl.sum(tl.where(inside, tl.exp(x - top), 0.0), 0)), 0.0)
    left = inside
    for i in tl.static_range(K):
        best = tl.max(tl.where(left, x, float("-inf")), 0)
        at = tl.min(tl.where(left & (x == best), cols, BLOCK), 0)
        if LOG_SOFTMAX:
            best = best - top - log_sum
        tl.store(val_ptr + row * K + i, best.to(val_ptr.dtype.element_ty))
        tl.store(idx_ptr + row * K + i, at.to(tl.int64))
        left = left & (cols != at)


def fits(x: torch.Tensor, k: int) -> bool:
    """Whether topk takes rows of x's width and k (else torch.topk is the path)."""
    return 1 <= k <= min(MAX_K, x.shape[-1]) and x.shape[-1] <= MAX_WIDTH and x.dtype in (
        torch.float32, torch.bfloat16, torch.float16)


def topk(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x [..., V], largest first, as torch.topk's
    (of torch.log_softmax(x, -1) with log_softmax, whose values are fp32 like log_softmax of fp32 logits)."""
    if not fits(x, k):
        raise ValueError(f"topk takes rows of at most {MAX_WIDTH} fp32/bf16/fp16 entries and 1 <= k <= "
                         f"min({MAX_K}, width), not {x.dtype} rows of {x.shape[-1]} with k = {k}")
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    values = torch.empty((rows.shape[0], k), dtype=torch.float32 if log_softmax else x.dtype, device=x.device)
    indices = torch.empty((rows.shape[0], k), dtype=torch.long, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _topk_kernel[(rows.shape[0],)](rows, values, indices, width, K=k, BLOCK=block, LOG_SOFTMAX=log_softmax,
                                       num_warps=8 if block >= 4096 else 4)
    return values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k)
