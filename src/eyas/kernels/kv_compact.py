"""A verified tree's KV compaction in one launch (eyas.layers.kv_cache.KVCache.compact_path's meaning).

The torch ops work out the columns, gather the accepted ones of every layer and write them back by advanced
indexing: several launches per cycle in its CUDA graph. Here one program per (sequence, layer, head) works out
its row's columns and loads all of them, keys and values, before it stores any, so a path that moves column
c+2 to c+1 and c+4 to c+2 reads each column before it is overwritten. The execution plan's
tree_kernels=False keeps the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _kv_compact_kernel(k_ptr, v_ptr, slots_ptr, starts_ptr, sel_ptr, accepted_ptr, L, HEADS, s_layer, s_slot, s_head,
                       s_col, D, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, HAS_V: tl.constexpr,
                       USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1)
    base = (lh // HEADS).to(tl.int64) * s_layer + tl.load(slots_ptr + r) * s_slot + (lh % HEADS).to(tl.int64) * s_head
    cols = tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    inside = (cols < L)[:, None] & (d < D)[None, :]
    start = tl.load(starts_ptr + r)
    src = start + tl.load(sel_ptr + r * L + cols, mask=cols < L, other=0)
    dst = start + tl.where(cols <= tl.load(accepted_ptr + r), cols, 0)
    at_src = base + src[:, None] * s_col + d[None, :]
    at_dst = base + dst[:, None] * s_col + d[None, :]
    keys = tl.load(k_ptr + at_src, mask=inside)
    if HAS_V:
        values = tl.load(v_ptr + at_src, mask=inside)
    tl.store(k_ptr + at_dst, keys, mask=inside)
    if HAS_V:
        tl.store(v_ptr + at_dst, values, mask=inside)


def kv_compact(k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, starts: torch.Tensor, sel: torch.Tensor,
               accepted: torch.Tensor):
    """KVCache.compact_path on k (and v unless None): contiguous [layers, rows, heads, columns, D] caches; slots,
    starts, accepted int64 [n]; sel int64 [n, L]."""
    n, L = sel.shape
    if k.dim() != 5 or not k.is_contiguous() or (v is not None and (v.shape != k.shape or not v.is_contiguous())) \
            or any(t.shape != (n,) for t in (slots, starts, accepted)) \
            or any(t.dtype != torch.long for t in (slots, starts, sel, accepted)):
        raise ValueError(f"kv_compact: a contiguous [layers, rows, heads, columns, D] cache, int64 slots, starts and "
                         f"accepted [n] and sel [n, L]; got cache {tuple(k.shape)}, "
                         f"{[(tuple(t.shape), t.dtype) for t in (slots, starts, sel, accepted)]}")
    layers, _, heads, _, D = k.shape
    if n and L:
        _kv_compact_kernel[(n, layers * heads)](k, k if v is None else v, slots.contiguous(), starts.contiguous(),
                                                sel.contiguous(), accepted.contiguous(), L, heads, *k.stride()[:4], D,
                                                BLOCK_L=triton.next_power_of_2(L), BLOCK_D=triton.next_power_of_2(D),
                                                HAS_V=v is not None, **pdl_args(k))
