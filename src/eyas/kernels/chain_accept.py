"""Greedy acceptance of a verified chain, in one launch (eyas.layers.draft_tree.accept_greedy_chain's meaning).

A chain's acceptance is a dozen tiny torch ops on [B, L] integers (compare, cast, running product, sum,
arange, two wheres, a gather, a roll): each a launch of ~2-4 µs inside a cycle's CUDA graph, where one
program per row does all of it: 12 launches fewer per cycle (docs/kernels.md). The execution plan's
accept_kernel=False keeps the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _chain_accept_kernel(tokens_ptr, argmax_ptr, sel_ptr, accepted_ptr, new_ptr, L, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64) * L
    cols = tl.arange(0, BLOCK)
    nxt_ok = cols + 1 < L
    drafted = tl.load(tokens_ptr + row + cols + 1, mask=nxt_ok, other=0)   # the token after each node
    target = tl.load(argmax_ptr + row + cols, mask=cols < L, other=0)    # the target's pick at each node
    # Node j + 1 is accepted while every drafted token up to it equals the target's pick before it; the last
    # node has no child, so the count stops there at the latest.
    wrong = (drafted != target) | (cols + 1 >= L)
    accepted = tl.min(tl.where(wrong, cols, BLOCK), 0)
    bonus = tl.load(argmax_ptr + row + accepted)
    inside = cols < L
    tl.store(sel_ptr + row + cols, tl.where(cols <= accepted, cols, 0).to(tl.int64), mask=inside)
    tl.store(new_ptr + row + cols, tl.where(cols < accepted, drafted, bonus).to(tl.int64), mask=inside)
    tl.store(accepted_ptr + tl.program_id(0), accepted.to(tl.int64))


def chain_accept(tokens: torch.Tensor, target_argmax: torch.Tensor):
    """(sel [B, L], accepted [B], new [B, L]) as accept_greedy_chain returns them; int64 [B, L] inputs."""
    if tokens.shape != target_argmax.shape or tokens.dim() != 2 or tokens.dtype != torch.long \
            or target_argmax.dtype != torch.long:
        raise ValueError(f"chain_accept: tokens {tuple(tokens.shape)} {tokens.dtype} and target_argmax "
                         f"{tuple(target_argmax.shape)} {target_argmax.dtype} must be int64 [B, L] alike")
    B, L = tokens.shape
    sel, new = (torch.empty((B, L), dtype=torch.long, device=tokens.device) for _ in range(2))
    accepted = torch.empty(B, dtype=torch.long, device=tokens.device)
    if B and L:
        _chain_accept_kernel[(B,)](tokens.contiguous(), target_argmax.contiguous(), sel, accepted, new, L,
                                   BLOCK=triton.next_power_of_2(L), **pdl_args(tokens))
    return sel, accepted, new
