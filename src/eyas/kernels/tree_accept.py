"""Greedy acceptance of a verified draft tree, in one launch (eyas.layers.draft_tree.accept_greedy_batched's meaning).

The torch ops of a tree's acceptance are about twenty launches of ~3 µs on [B, N] integers inside a cycle's
CUDA graph; here one program per row does all of it. It reads the tree's ancestor mask (the one the verify
pass attended with): a node is accepted when every node its row of the mask names matched the target's
pick at its parent, and the deepest accepted node's row is the path. The execution plan's
tree_kernels=False keeps the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _tree_accept_kernel(tokens_ptr, parents_ptr, depth_ptr, mask_ptr, argmax_ptr, sel_ptr, accepted_ptr, new_ptr,
                        N, L, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N)
    inside = nodes < N
    tokens = tl.load(tokens_ptr + b * N + nodes, mask=inside, other=0)
    up = tl.maximum(tl.load(parents_ptr + b * N + nodes, mask=inside, other=0), 0)
    depth = tl.load(depth_ptr + b * N + nodes, mask=inside, other=0)
    picked = tl.load(argmax_ptr + b * N + up, mask=inside, other=0)      # the target's pick at each parent
    wrong = (tokens != picked) & (nodes > 0) & inside                    # the root is always accepted
    # Node i is accepted when no node of its mask row (itself and its ancestors) is wrong.
    rows = b * N * N + nodes[:, None] * N + nodes[None, :]
    both = inside[:, None] & inside[None, :]
    sees = tl.load(mask_ptr + rows, mask=both, other=0) != 0
    bad = tl.max(tl.where(sees & wrong[None, :], 1, 0), axis=1)
    ok = (bad == 0) & inside
    accepted = tl.max(tl.where(ok, depth, -1), axis=0)                  # the deepest accepted node's depth
    best = tl.min(tl.where(ok & (depth == accepted), nodes, BLOCK_N), axis=0)   # first such node, as argmax
    on_path = (tl.load(mask_ptr + b * N * N + best * N + nodes, mask=inside, other=0) != 0) & inside
    bonus = tl.load(argmax_ptr + b * N + best)
    cols = tl.arange(0, BLOCK_L)
    at = on_path[None, :] & (depth[None, :] == cols[:, None])            # [L, N]: the path's node at depth col
    sel = tl.sum(tl.where(at, nodes[None, :], 0), axis=1)               # 0 past the path's end
    after = on_path[None, :] & (depth[None, :] == cols[:, None] + 1)     # the path's node one deeper
    drafted = tl.sum(tl.where(after, tokens[None, :], 0), axis=1)
    in_l = cols < L
    tl.store(sel_ptr + b * L + cols, sel.to(tl.int64), mask=in_l)
    tl.store(new_ptr + b * L + cols, tl.where(cols < accepted, drafted, bonus).to(tl.int64), mask=in_l)
    tl.store(accepted_ptr + b, accepted.to(tl.int64))


def tree_accept(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor,
                target_argmax: torch.Tensor, max_depth: int):
    """(sel [B, L], accepted [B], new [B, L]) with L = max_depth + 1, as accept_greedy_batched returns them;
    tokens, parents, depth, target_argmax int64 [B, N], mask bool [B, N, N]."""
    longs = (tokens, parents, depth, target_argmax)
    B, N = tokens.shape if tokens.dim() == 2 else (-1, -1)
    if B < 0 or any(t.shape != (B, N) or t.dtype != torch.long for t in longs) \
            or mask.shape != (B, N, N) or mask.dtype != torch.bool:
        raise ValueError(f"tree_accept: tokens, parents, depth and target_argmax must be int64 [B, N] alike and the "
                         f"mask bool [B, N, N]; got {[tuple(t.shape) for t in longs]}, mask {tuple(mask.shape)} "
                         f"{mask.dtype}")
    L = max_depth + 1
    sel, new = (torch.empty((B, L), dtype=torch.long, device=tokens.device) for _ in range(2))
    accepted = torch.empty(B, dtype=torch.long, device=tokens.device)
    if B and N:
        _tree_accept_kernel[(B,)](tokens.contiguous(), parents.contiguous(), depth.contiguous(),
                                  mask.contiguous().view(torch.uint8), target_argmax.contiguous(), sel, accepted,
                                  new, N, L, BLOCK_N=triton.next_power_of_2(N), BLOCK_L=triton.next_power_of_2(L),
                                  **pdl_args(tokens))
    return sel, accepted, new
