"""A draft tree's node selection in one launch (eyas.layers.draft_tree.select_tree's meaning).

Choosing the num_nodes - 1 best candidates of the draft's pool, renumbering their parents and building the
ancestor mask are about twenty small torch ops (top-k, sort, gathers, searchsorted, cats, a scatter per
generation) inside the draft's CUDA graph. Here one program per row does all of it:
  1. each candidate's rank by its key (cumulative log-probability less a 1e-6 depth penalty), ties to the
     lower pool index as the top-k kernel breaks them, counted a chunk of the pool at a time;
  2. the kept candidates, in pool order, become nodes 1.. (node 0 is the root): token, depth and pool index
     are stored at their node;
  3. each node's parent node: the kept candidates before its parent's pool index, plus one;
  4. the ancestor mask, a generation at a time, in registers.
Steps 3 and 4 read back what step 2 stored, behind a barrier. The execution plan's tree_kernels=False keeps the
torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous

CHUNK = 32  # pool entries compared against all of them at once in step 1


@triton.jit
def _key(scores_ptr, depth_ptr, row_s, row_d, idx, inside):
    score = tl.load(scores_ptr + row_s + idx, mask=inside, other=float("-inf"))
    depth = tl.load(depth_ptr + row_d + idx, mask=inside, other=0)
    return score - 1e-6 * depth.to(tl.float32)


@triton.jit
def _tree_select_kernel(root_ptr, tok_ptr, scores_ptr, par_ptr, depth_ptr, s_tok, s_scores, s_par, s_depth,
                        out_tok, out_par, out_depth, out_mask, P, N, MAX_DEPTH,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_P: tl.constexpr,
                        USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    in_pool = p < P
    key = _key(scores_ptr, depth_ptr, b * s_scores, b * s_depth, p, in_pool)
    rank = tl.zeros((BLOCK_P,), dtype=tl.int32)
    for q0 in range(0, P, CHUNK_P):
        q = q0 + tl.arange(0, CHUNK_P)
        other = _key(scores_ptr, depth_ptr, b * s_scores, b * s_depth, q, q < P)
        ahead = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None]) & (q[None, :] < p[:, None]))
        rank += tl.sum((ahead & (q < P)[None, :]).to(tl.int32), axis=1)
    kept = in_pool & (rank < N - 1)
    node = tl.cumsum(kept.to(tl.int32), axis=0)                          # 1.. in pool order where kept
    tl.store(out_tok + b * N + node, tl.load(tok_ptr + b * s_tok + p, mask=kept, other=0), mask=kept)
    tl.store(out_depth + b * N + node, tl.load(depth_ptr + b * s_depth + p, mask=kept, other=0), mask=kept)
    tl.store(out_par + b * N + node, p.to(tl.int64), mask=kept)          # the pool index, for now
    tl.store(out_tok + b * N, tl.load(root_ptr + b))
    tl.store(out_depth + b * N, 0)
    tl.debug_barrier()
    n = tl.arange(0, BLOCK_N)
    is_node = (n >= 1) & (n < N)
    # Read back past L1 (.cg): what this program's threads stored above.
    pool_of = tl.load(out_par + b * N + n, mask=is_node, other=P, cache_modifier=".cg")
    parent_pool = tl.load(par_ptr + b * s_par + pool_of, mask=is_node, other=-1)
    before = (pool_of[None, :] < parent_pool[:, None]) & is_node[None, :]
    up = tl.where(parent_pool >= 0, 1 + tl.sum(before.to(tl.int32), axis=1), 0)   # the root is its own parent
    tl.debug_barrier()
    tl.store(out_par + b * N + n, tl.where(n == 0, -1, up).to(tl.int64), mask=n < N)
    # Each node sees itself, the root and the generations between: max_depth - 1 above the deepest node.
    sees = (n[None, :] == n[:, None]) | (n[None, :] == 0)
    above = up
    for _ in range(1, MAX_DEPTH):
        sees |= n[None, :] == above[:, None]
        above = tl.sum(tl.where(n[None, :] == above[:, None], up[None, :], 0), axis=1)   # up[above]
    inside = (n < N)[:, None] & (n < N)[None, :]
    tl.store(out_mask + b * N * N + n[:, None] * N + n[None, :], sees.to(tl.uint8), mask=inside)


def tree_select(root: torch.Tensor, pool_tokens: torch.Tensor, pool_scores: torch.Tensor, pool_parents: torch.Tensor,
                pool_depth: torch.Tensor, num_nodes: int, max_depth: int):
    """(tokens, parents, depth, mask) as select_tree's DraftTree holds them: int64 [B, N] and bool [B, N, N].

    root int64 [B]; pool_tokens, pool_parents, pool_depth int64 [B, P] (rows may be one row expanded), pool_scores
    fp32 [B, P]; the pool holds at least num_nodes - 1 candidates."""
    B, P = pool_scores.shape
    pools = (pool_tokens, pool_parents, pool_depth)
    if root.shape != (B,) or any(t.shape != (B, P) or t.dtype != torch.long for t in pools) \
            or root.dtype != torch.long or pool_scores.dtype != torch.float32 or not 1 <= num_nodes <= P + 1 \
            or any(t.stride(1) != 1 for t in (*pools, pool_scores)):
        raise ValueError(f"tree_select: root int64 [B], the pool's tokens, parents and depths int64 [B, P] and scores "
                         f"fp32 [B, P] with unit column stride, 1 <= num_nodes <= P + 1; got root "
                         f"{tuple(root.shape)}, pool {[(tuple(t.shape), t.dtype) for t in (*pools, pool_scores)]}, "
                         f"num_nodes {num_nodes}")
    dev = root.device
    tokens, parents, depth = (torch.empty((B, num_nodes), dtype=torch.long, device=dev) for _ in range(3))
    mask = torch.empty((B, num_nodes, num_nodes), dtype=torch.bool, device=dev)
    if B:
        _tree_select_kernel[(B,)](root.contiguous(), pool_tokens, pool_scores, pool_parents, pool_depth,
                                  pool_tokens.stride(0), pool_scores.stride(0), pool_parents.stride(0),
                                  pool_depth.stride(0), tokens, parents, depth, mask.view(torch.uint8), P, num_nodes,
                                  max_depth, BLOCK_P=triton.next_power_of_2(P), BLOCK_N=triton.next_power_of_2(num_nodes),
                                  CHUNK_P=min(CHUNK, triton.next_power_of_2(P)), **pdl_args(root))
    return tokens, parents, depth, mask
