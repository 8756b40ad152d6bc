"""The attention's first three launches of a decode-shaped layer in one: residual add + RMSNorm + the fused
q/k/v projection (eyas.kernels.fused_linear.norm_linear), then the rotary embedding of q and k and the KV-cache
write (eyas.kernels.rotary.rotate_and_store), folded into the projection's epilogue.

The rotary pairs feature d of a head with feature d + D/2, which a plain output tile holds in different
programs. Here each program owns BLOCK_H such pairs: it projects the rows onto both weight rows of each pair
(two products over the same normed rows), so the epilogue holds x1 and x2 side by side. q heads are rotated
into a new q tensor; k heads are rotated and v heads copied into their KV-cache columns.

Each intermediate is rounded where the unfused kernels store it: the projection's output as norm_linear
writes it, then the rotary op by op as rotate_and_store computes it (the kernel runs without multiply-add
fusion, as rotate_and_store does, so that fp32 products are rounded before their sum). In Triton's
interpreter it equals the two kernels bit for bit; compiled, its sums over K may run in another order than
norm_linear's tile does (and without its multiply-adds), so fp32 results can differ in the last bits. The
layer (eyas.layers.qkv_rotary) takes it at one row by default, where it measured faster.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from eyas.kernels import tile_choice
from eyas.kernels.fused_linear import KERNEL_ROWS, MAX_K, PRODUCT_LIMIT, residual_chunk
from eyas.kernels.pdl import pdl_args, wait_for_previous
from eyas.kernels.rounding import rounded


@triton.jit
def _norm_qkv_rotary_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, h_ptr, q_ptr, k_cache, v_cache, cos_ptr, sin_ptr,
                            pos_ptr, slots, write_pos, M, K, T, q_heads, kv_heads, half, eps, kc_s, kc_h, kc_c,
                            vc_s, vc_h, vc_c, table_stride, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                            USE_PDL: tl.constexpr):
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pair = (pid * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # (head, d) with d < half, head-major
    pair_ok = pair < (q_heads + 2 * kv_heads) * half
    head, d = pair // half, pair % half
    lo = head * 2 * half + d                                      # weight rows of the pair: d and d + half
    cols = tl.arange(0, BLOCK_K)
    w_mask = pair_ok[:, None] & (cols < K)[None, :]
    # The weights first: no kernel writes them, so with PDL their load overlaps the previous kernel.
    w1 = tl.load(w_ptr + lo[:, None] * K + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + (lo + half)[:, None] * K + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    h, offs, mask = residual_chunk(x_ptr, d_ptr, rows, cols, M, K, HAS_DELTA)
    if HAS_DELTA:
        if pid == 0:
            tl.store(h_ptr + offs, h.to(dtype), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=1) / K + eps)
    xn = rounded(nw[None, :] * rounded(h * inv_rms[:, None], dtype), dtype)
    y1 = tl.sum(xn[:, None, :] * w1[None, :, :], axis=2)          # [BLOCK_M, BLOCK_H]
    y2 = tl.sum(xn[:, None, :] * w2[None, :, :], axis=2)
    if HAS_BIAS:
        y1 += tl.load(b_ptr + lo, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        y2 += tl.load(b_ptr + lo + half, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    # The projection's output as norm_linear stores it, then the rotary as rotate_and_store computes it.
    x1, x2 = y1.to(dtype).to(tl.float32), y2.to(dtype).to(tl.float32)
    row_ok = rows < M
    b = (rows // T).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    table = pos[:, None] * table_stride + d[None, :]
    ok = row_ok[:, None] & pair_ok[None, :]
    c1 = rounded(tl.load(cos_ptr + table, mask=ok, other=0.0).to(tl.float32), dtype)
    c2 = rounded(tl.load(cos_ptr + table + half, mask=ok, other=0.0).to(tl.float32), dtype)
    s1 = rounded(tl.load(sin_ptr + table, mask=ok, other=0.0).to(tl.float32), dtype)
    s2 = rounded(tl.load(sin_ptr + table + half, mask=ok, other=0.0).to(tl.float32), dtype)
    r1 = rounded(rounded(x1 * c1, dtype) + rounded(-x2 * s1, dtype), dtype)
    r2 = rounded(rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype), dtype)
    is_q = (head < q_heads)[None, :]
    is_k = ((head >= q_heads) & (head < q_heads + kv_heads))[None, :]
    is_v = (head >= q_heads + kv_heads)[None, :]
    q_out = q_ptr + rows[:, None].to(tl.int64) * (q_heads * 2 * half) + lo[None, :]
    tl.store(q_out, r1.to(dtype), mask=ok & is_q)
    tl.store(q_out + half, r2.to(dtype), mask=ok & is_q)
    slot = tl.load(slots + b, mask=row_ok, other=0).to(tl.int64)
    col = tl.load(write_pos + rows, mask=row_ok, other=0).to(tl.int64)
    k_head = tl.maximum(head - q_heads, 0)
    v_head = tl.maximum(head - q_heads - kv_heads, 0)
    k_out = k_cache + slot[:, None] * kc_s + k_head[None, :] * kc_h + col[:, None] * kc_c + d[None, :]
    tl.store(k_out, r1.to(dtype), mask=ok & is_k)
    tl.store(k_out + half, r2.to(dtype), mask=ok & is_k)
    v_out = v_cache + slot[:, None] * vc_s + v_head[None, :] * vc_h + col[:, None] * vc_c + d[None, :]
    tl.store(v_out, x1.to(dtype), mask=ok & is_v)
    tl.store(v_out + half, x2.to(dtype), mask=ok & is_v)


# BLOCK_H pairs per program, timed at first use of each shape on a GPU (eyas.kernels.tile_choice).
CONFIGS = [triton.Config({"BLOCK_H": n}, num_warps=w) for n in (2, 4, 8, 16) for w in (4, 8)]
_INTERPRETER_BLOCK_H = 64  # Triton's CPU interpreter steps through every program: the fewer, the faster


def _candidates(m: int, k: int, block_h: int | None = None) -> list:
    """The tiles whose two [rows, BLOCK_H, K] products fit (PRODUCT_LIMIT, as the fused projections' tiles);
    with block_h (norm_qkv_rotary's timing keyword) only those of that many pairs, whether they fit or not,
    so that a whole step can time tiles that timing the kernel alone would not pick."""
    if block_h is not None:
        sizes = sorted({c.kwargs["BLOCK_H"] for c in CONFIGS})
        if block_h not in sizes:
            raise ValueError(f"block_h={block_h!r}: pairs per program must be one of {sizes}")
        return [c for c in CONFIGS if c.kwargs["BLOCK_H"] == block_h]
    m, k = triton.next_power_of_2(m), triton.next_power_of_2(k)
    return [c for c in CONFIGS if 2 * m * c.kwargs["BLOCK_H"] * k <= PRODUCT_LIMIT] or CONFIGS[:1]


def norm_qkv_rotary(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None, q_heads: int, kv_heads: int, cos: torch.Tensor,
                    sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, write_pos: torch.Tensor,
                    block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, q): h = x + delta (x when delta is None) and q rotated, [B, T, q_heads, D]; the rotated k and v land
    in their caches. What norm_linear(x, delta, norm_weight, eps, weight, bias) followed by rotate_and_store
    on the q/k/v split of its output does. x [B, T, K]; weight [(q_heads + 2 kv_heads) * D, K] (q, k, v rows);
    cos/sin [max_positions, D]; positions and write_pos [B, T]; slots [B]; caches [num_slots, kv_heads,
    max_len, D] with unit stride along D; x, weights and caches one dtype. block_h: time only tiles of that
    many pairs per program (for benchmarks; by default every tile that fits)."""
    B, T, K = x.shape
    D = cos.shape[-1]
    if D % 2 or sin.shape != cos.shape or weight.shape != ((q_heads + 2 * kv_heads) * D, K):
        raise ValueError(f"norm_qkv_rotary: weight {tuple(weight.shape)} must be [({q_heads} + 2 x {kv_heads}) x "
                         f"{D}, {K}] for cos/sin tables {tuple(cos.shape)} of an even head dim")
    if B * T > KERNEL_ROWS or K > MAX_K:
        raise ValueError(f"norm_qkv_rotary: {B * T} rows of {K} features exceed the {KERNEL_ROWS} x {MAX_K} it takes")
    if len({x.dtype, weight.dtype, norm_weight.dtype, k_cache.dtype, v_cache.dtype}) != 1 \
            or (delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype)):
        raise TypeError("norm_qkv_rotary: x, delta, the weights and the caches must share one dtype and shape")
    if positions.shape != (B, T) or write_pos.shape != (B, T) or slots.shape != (B,):
        raise ValueError(f"norm_qkv_rotary: positions {tuple(positions.shape)}, write_pos {tuple(write_pos.shape)} "
                         f"and slots {tuple(slots.shape)} do not fit a batch of {B} x {T}")
    if k_cache.shape[1] != kv_heads or k_cache.shape[3] != D or k_cache.stride(3) != 1 \
            or v_cache.shape != k_cache.shape or v_cache.stride(3) != 1:
        raise ValueError(f"norm_qkv_rotary: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"[slots, {kv_heads}, max_len, {D}] with unit stride along the head dim")
    xr = x.reshape(B * T, K).contiguous()
    dr = delta.reshape(B * T, K).contiguous() if delta is not None else xr
    h = torch.empty_like(xr) if delta is not None else xr
    q = torch.empty((B, T, q_heads, D), dtype=x.dtype, device=x.device)
    if B * T == 0:
        return h.view(x.shape), q
    w = weight.contiguous()
    args = [xr, dr, norm_weight.contiguous(), w, bias if bias is not None else w, h, q, k_cache, v_cache,
            cos.contiguous(), sin.contiguous(), positions.contiguous(), slots, write_pos.contiguous(), B * T, K, T,
            q_heads, kv_heads, D // 2, eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.shape[1]]
    meta = dict(HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(B * T),
                BLOCK_K=triton.next_power_of_2(K), enable_fp_fusion=False, **pdl_args(x))
    pairs = (q_heads + 2 * kv_heads) * D // 2
    if not x.is_cuda:
        _norm_qkv_rotary_kernel[(triton.cdiv(pairs, _INTERPRETER_BLOCK_H),)](*args, BLOCK_H=_INTERPRETER_BLOCK_H,
                                                                              **meta)
        return h.view(x.shape), q

    key = ("_norm_qkv_rotary_kernel", B * T, pairs, K, x.dtype, x.device, tuple(sorted(meta.items())), block_h)
    tile_choice.launch_chosen(_norm_qkv_rotary_kernel, key, lambda: _candidates(B * T, K, block_h), args, 3,
                              lambda tile: (triton.cdiv(pairs, tile.kwargs["BLOCK_H"]),), **meta)
    return h.view(x.shape), q
