"""A verified tree's KV compaction in one launch (eyas.layers.kv_cache.KVCache.compact's meaning).

The torch ops gather the accepted columns of every layer and write them back by advanced indexing: a
handful of launches per cycle in its CUDA graph, and as many again for the values. Here one program per
(sequence, layer, head) loads its row's source columns, keys and values, before it stores any of them, so
a path that moves column c+2 to c+1 and c+4 to c+2 reads each column before it is overwritten. The
execution plan's tree_kernels=False keeps the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _kv_compact_kernel(k_ptr, v_ptr, slots_ptr, src_ptr, dst_ptr, L, HEADS, s_layer, s_slot, s_head, s_col, D,
                       BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, HAS_V: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1)
    base = (lh // HEADS).to(tl.int64) * s_layer + tl.load(slots_ptr + r) * s_slot + (lh % HEADS).to(tl.int64) * s_head
    cols = tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    inside = (cols < L)[:, None] & (d < D)[None, :]
    src = tl.load(src_ptr + r * L + cols, mask=cols < L, other=0)
    dst = tl.load(dst_ptr + r * L + cols, mask=cols < L, other=0)
    at_src = base + src[:, None] * s_col + d[None, :]
    at_dst = base + dst[:, None] * s_col + d[None, :]
    keys = tl.load(k_ptr + at_src, mask=inside)
    if HAS_V:
        values = tl.load(v_ptr + at_src, mask=inside)
    tl.store(k_ptr + at_dst, keys, mask=inside)
    if HAS_V:
        tl.store(v_ptr + at_dst, values, mask=inside)


def kv_compact(k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """Move columns src[i] to dst[i] of cache row slots[i], every layer and head, in k (and v unless None).

    k, v: contiguous [layers, rows, heads, columns, D]; slots int64 [n]; src, dst int64 [n, L]."""
    n, L = src.shape
    if k.dim() != 5 or not k.is_contiguous() or (v is not None and (v.shape != k.shape or not v.is_contiguous())) \
            or slots.shape != (n,) or dst.shape != (n, L) \
            or any(t.dtype != torch.long for t in (slots, src, dst)):
        raise ValueError(f"kv_compact: a contiguous [layers, rows, heads, columns, D] cache and int64 slots [n], "
                         f"src and dst [n, L]; got cache {tuple(k.shape)}, slots {tuple(slots.shape)} {slots.dtype}, "
                         f"src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}")
    layers, _, heads, _, D = k.shape
    if n and L:
        _kv_compact_kernel[(n, layers * heads)](k, k if v is None else v, slots.contiguous(), src.contiguous(),
                                                dst.contiguous(), L, heads, *k.stride()[:4], D,
                                                BLOCK_L=triton.next_power_of_2(L), BLOCK_D=triton.next_power_of_2(D),
                                                HAS_V=v is not None, **pdl_args(k))
