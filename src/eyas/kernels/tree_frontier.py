"""One step of a draft tree's frontier in one launch (eyas.layers.draft_tree.expand_frontier's meaning).

After the draft runs over its k frontier nodes, the torch ops pool their k * k children, take the k best by
cumulative log-probability and gather the new frontier's ids, hidden states and attention mask: about ten
small launches per draft step inside the draft's CUDA graph. Here program (b, i) ranks row b's k * k
candidates itself (ties to the lower index, as the top-k kernel breaks them), keeps the i-th best as frontier
node i (its score, id, pool index, its parent's hidden state and mask row), and pools frontier node i's own
k children. The execution plan's tree_kernels=False keeps the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _tree_frontier_kernel(scores_ptr, cs_ptr, cid_ptr, fr_ptr, out_ptr, mask_ptr, s_fr, s_mask,
                          pool_tok, pool_sc, pool_par, base, P,
                          next_scores, next_ids, next_hidden, next_fr, next_mask, K, W, H,
                          BLOCK_KK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                          BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    j = tl.arange(0, BLOCK_KK)
    inj = j < K * K
    cum = tl.load(scores_ptr + b * K + j // K, mask=inj, other=0.0) + tl.load(cs_ptr + b * K * K + j, mask=inj,
                                                                              other=0.0)
    ahead = (cum[None, :] > cum[:, None]) | ((cum[None, :] == cum[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((ahead & inj[None, :]).to(tl.int32), axis=1)
    best = tl.sum(tl.where(inj & (rank == i), j, 0), axis=0)            # the i-th best candidate
    parent = best // K
    me = b * K + i
    tl.store(next_scores + me, tl.sum(tl.where(j == best, cum, 0.0), axis=0))
    tl.store(next_ids + me, tl.load(cid_ptr + b * K * K + best))
    tl.store(next_fr + me, (base + best).to(tl.int64))
    h = tl.arange(0, BLOCK_H)
    row = tl.load(out_ptr + (b * K + parent) * H + h, mask=h < H)
    tl.store(next_hidden + me * H + h, row, mask=h < H)
    # A child sees what its parent saw (the parent's ancestors and the parent), then itself.
    w = tl.arange(0, BLOCK_W)
    seen = tl.load(mask_ptr + b * s_mask + parent * W + w, mask=w < W, other=0)
    tl.store(next_mask + me * (W + K) + w, seen, mask=w < W)
    c = tl.arange(0, BLOCK_K)
    tl.store(next_mask + me * (W + K) + W + c, (c == i).to(tl.uint8), mask=c < K)
    # Frontier node i's own children go to pool columns base + i*K ..
    mine = c < K
    at = b * P + base + i * K + c
    tl.store(pool_tok + at, tl.load(cid_ptr + b * K * K + i * K + c, mask=mine, other=0), mask=mine)
    tl.store(pool_sc + at, tl.load(scores_ptr + b * K + i) + tl.load(cs_ptr + b * K * K + i * K + c, mask=mine,
                                                                     other=0.0), mask=mine)
    tl.store(pool_par + at, tl.zeros((BLOCK_K,), dtype=tl.int64) + tl.load(fr_ptr + b * s_fr + i), mask=mine)


def tree_frontier(pool, base: int, scores: torch.Tensor, child_scores: torch.Tensor, child_ids: torch.Tensor,
                  frontier: torch.Tensor, out: torch.Tensor, mask: torch.Tensor):
    """expand_frontier's (scores, ids, hidden, frontier, mask) and its writes to `pool` (a DraftPool of
    contiguous [B, P] tensors). scores fp32 [B, k]; child_scores fp32 and child_ids int64 [B, k, k]; frontier
    int64 [B, k]; out [B, k, H]; mask bool [B, k, W]. frontier and mask may be one row expanded over B."""
    B, K = scores.shape
    W, H, P = mask.shape[-1], out.shape[-1], pool.tokens.shape[1]
    if scores.dtype != torch.float32 or child_scores.shape != (B, K, K) or child_scores.dtype != torch.float32 \
            or child_ids.shape != (B, K, K) or child_ids.dtype != torch.long or frontier.shape != (B, K) \
            or frontier.dtype != torch.long or frontier.stride(1) != 1 or out.shape != (B, K, H) \
            or mask.shape != (B, K, W) or mask.dtype != torch.bool or mask.stride()[1:] != (W, 1) \
            or any(not t.is_contiguous() or t.shape != (B, P) for t in (pool.tokens, pool.scores, pool.parents)) \
            or pool.scores.dtype != torch.float32 or pool.tokens.dtype != torch.long \
            or pool.parents.dtype != torch.long or base + K * K > P:
        raise ValueError(f"tree_frontier: scores fp32 [B, k], child scores fp32 and ids int64 [B, k, k], frontier "
                         f"int64 [B, k], out [B, k, H], mask bool [B, k, W] with rows of unit stride, a contiguous "
                         f"[B, P] pool (int64 tokens and parents, fp32 scores) with room from column {base}; got "
                         f"scores {tuple(scores.shape)} {scores.dtype}, children {tuple(child_scores.shape)} "
                         f"{tuple(child_ids.shape)}, frontier "
                         f"{tuple(frontier.shape)}, out {tuple(out.shape)}, mask {tuple(mask.shape)} {mask.dtype}, "
                         f"pool {tuple(pool.tokens.shape)}")
    dev = scores.device
    next_scores = torch.empty((B, K), dtype=torch.float32, device=dev)
    next_ids, next_fr = (torch.empty((B, K), dtype=torch.long, device=dev) for _ in range(2))
    next_hidden = torch.empty((B, K, H), dtype=out.dtype, device=dev)
    next_mask = torch.empty((B, K, W + K), dtype=torch.bool, device=dev)
    if B:
        _tree_frontier_kernel[(B, K)](scores.contiguous(), child_scores.contiguous(), child_ids.contiguous(), frontier,
                                      out.contiguous(), mask.view(torch.uint8), frontier.stride(0), mask.stride(0),
                                      pool.tokens, pool.scores, pool.parents, base, P, next_scores, next_ids,
                                      next_hidden, next_fr, next_mask.view(torch.uint8), K, W, H,
                                      BLOCK_KK=triton.next_power_of_2(K * K), BLOCK_K=triton.next_power_of_2(K),
                                      BLOCK_W=triton.next_power_of_2(W), BLOCK_H=triton.next_power_of_2(H),
                                      **pdl_args(scores))
    return next_scores, next_ids, next_hidden, next_fr, next_mask
