"""Rotary position embedding for q and k in one kernel, and the same fused with the KV-cache write.

The torch reference (eyas.layers.rotary.RotaryEmbedding.forward) launches about fourteen kernels: two
table gathers and casts, and for each of q and k a rotate-half (slices, negation, concatenation), two
products and a sum. At batch 1 these launches, not the arithmetic, are the cost; here one launch rotates
every head of q and k, reading them in place (strided views out of a fused qkv projection are fine).

Rounding follows torch op by op: the cos/sin rows are cast to q's dtype, q * cos and rotate_half(q) * sin
are each rounded to that dtype, and so is their sum; all of it computed in fp32, as torch's elementwise
kernels do, and with multiply-add fusion turned off (torch rounds each product before the sum), so results
are bit-identical to the reference in fp32, bf16 and fp16.

`rotate_and_store` is the decode-shaped attention's first launch: it rotates q, and writes the rotated k
and the untouched v straight into their KV-cache columns (what `apply_rotary` followed by
eyas.kernels.slot_attention.store_kv does, in one launch instead of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous
from eyas.kernels.rounding import rounded


@triton.jit
def _rotate_head(src, src_stride, dst, cos_row, sin_row, offs, mask, half):
    """One head, or a [heads, half] tile of them (src, dst: a column of head pointers; offs: a row):
    out[:half] = x1*c1 - x2*s1, out[half:] = x2*c2 + x1*s2, each op rounded to x's dtype."""
    x1 = tl.load(src + offs * src_stride, mask=mask, other=0.0)
    x2 = tl.load(src + (offs + half) * src_stride, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = rounded(tl.load(cos_row + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    c2 = rounded(tl.load(cos_row + half + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    s1 = rounded(tl.load(sin_row + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    s2 = rounded(tl.load(sin_row + half + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = rounded(rounded(x1 * c1, dtype) + rounded(-x2 * s1, dtype), dtype)
    out2 = rounded(rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype), dtype)
    tl.store(dst + offs, out1.to(dtype), mask=mask)
    tl.store(dst + half + offs, out2.to(dtype), mask=mask)


@triton.jit
def _token_rows(cos_ptr, sin_ptr, pos_ptr, seq_len, pos_sb, pos_st, table_stride, half, HALF_BLOCK: tl.constexpr):
    """This program's token (b * T + t, grid axis 0), b, t, its cos/sin table rows, and the offsets and mask
    of a half head."""
    token = tl.program_id(0).to(tl.int64)
    b, t = token // seq_len, token % seq_len
    pos = tl.load(pos_ptr + b * pos_sb + t * pos_st).to(tl.int64)
    offs = tl.arange(0, HALF_BLOCK)
    return token, b, t, cos_ptr + pos * table_stride, sin_ptr + pos * table_stride, offs, offs < half


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, seq_len, q_heads, k_heads,
                   q_sb, q_st, q_sh, q_sd, k_sb, k_st, k_sh, k_sd, pos_sb, pos_st, table_stride, half,
                   HALF_BLOCK: tl.constexpr, QH_BLOCK: tl.constexpr, KH_BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """One token per program, all of its q and k heads as [heads, half] tiles: at prefill and training
    shapes one program per (token, head) meant hundreds of thousands of one-warp programs."""
    wait_for_previous(USE_PDL)
    token, b, t, cos_row, sin_row, offs, mask = _token_rows(cos_ptr, sin_ptr, pos_ptr, seq_len, pos_sb, pos_st,
                                                            table_stride, half, HALF_BLOCK)
    qh = tl.arange(0, QH_BLOCK)[:, None].to(tl.int64)
    _rotate_head(q_ptr + b * q_sb + t * q_st + qh * q_sh, q_sd, q_out_ptr + (token * q_heads + qh) * 2 * half,
                 cos_row, sin_row, offs[None, :], (qh < q_heads) & mask[None, :], half)
    kh = tl.arange(0, KH_BLOCK)[:, None].to(tl.int64)
    _rotate_head(k_ptr + b * k_sb + t * k_st + kh * k_sh, k_sd, k_out_ptr + (token * k_heads + kh) * 2 * half,
                 cos_row, sin_row, offs[None, :], (kh < k_heads) & mask[None, :], half)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
    """The arguments both launchers share; returns B, T, q heads, k heads and the head dim."""
    B, T, q_heads, D = q.shape
    if k.shape[:2] != (B, T) or k.shape[3] != D or positions.shape != (B, T):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} "
                         "must share B and T, and q and k the head dim")
    if k.dtype != q.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q ({q.dtype}) and k ({k.dtype}) must share one of fp32, bf16 and fp16")
    if D % 2 or cos.shape != sin.shape or cos.shape[1] != D:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)} must be [max_positions, {D}] with {D} even")
    return B, T, q_heads, k.shape[2], D


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding.forward: q [B, T, H, D] and k [B, T, Hk, D] (any strides, same dtype), cos/sin tables
    [max_positions, D], positions [B, T] (integers below max_positions, not checked). Returns new contiguous
    rotated (q, k)."""
    B, T, q_heads, k_heads, D = _check(q, k, cos, sin, positions)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if B * T == 0:
        return q_out, k_out
    pdl = pdl_args(q)
    _rotary_kernel[(B * T,)](
        q, k, q_out, k_out, cos, sin, positions, T, q_heads, k_heads, *q.stride(), *k.stride(),
        *positions.stride(), D, D // 2, HALF_BLOCK=triton.next_power_of_2(D // 2),
        QH_BLOCK=triton.next_power_of_2(q_heads), KH_BLOCK=triton.next_power_of_2(k_heads), num_warps=4,
        enable_fp_fusion=False, **pdl)
    return q_out, k_out


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache, v_cache, slots, write_pos, cos_ptr, sin_ptr,
                         pos_ptr, seq_len, q_heads, q_sb, q_st, q_sh, q_sd, k_sb, k_st, k_sh, k_sd,
                         v_sb, v_st, v_sh, v_sd, kc_s, kc_h, kc_c, vc_s, vc_h, vc_c, wp_sb, wp_st,
                         pos_sb, pos_st, table_stride, half, HALF_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    token, b, t, cos_row, sin_row, offs, mask = _token_rows(cos_ptr, sin_ptr, pos_ptr, seq_len, pos_sb, pos_st,
                                                            table_stride, half, HALF_BLOCK)
    head = tl.program_id(1).to(tl.int64)  # q heads first, then kv heads
    if head < q_heads:
        _rotate_head(q_ptr + b * q_sb + t * q_st + head * q_sh, q_sd,
                     q_out_ptr + (token * q_heads + head) * 2 * half, cos_row, sin_row, offs, mask, half)
    else:
        kv = head - q_heads
        slot = tl.load(slots + b).to(tl.int64)
        col = tl.load(write_pos + b * wp_sb + t * wp_st).to(tl.int64)
        _rotate_head(k_ptr + b * k_sb + t * k_st + kv * k_sh, k_sd,
                     k_cache + slot * kc_s + kv * kc_h + col * kc_c, cos_row, sin_row, offs, mask, half)
        src = v_ptr + b * v_sb + t * v_st + kv * v_sh
        dst = v_cache + slot * vc_s + kv * vc_h + col * vc_c
        tl.store(dst + offs, tl.load(src + offs * v_sd, mask=mask), mask=mask)
        tl.store(dst + half + offs, tl.load(src + (offs + half) * v_sd, mask=mask), mask=mask)


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     write_pos: torch.Tensor) -> torch.Tensor:
    """apply_rotary(q, k, ...) then store_kv(k_cache, v_cache, slots, write_pos, rotated k, v), in one launch.
    q [B, T, H, D], k and v [B, T, Hk, D] (any strides; one dtype, the caches'); caches [num_slots, Hk,
    max_len, D] with unit stride along D; slots [B]; write_pos and positions [B, T]. Returns the rotated q
    (new, contiguous); k and v land in the caches."""
    B, T, q_heads, k_heads, D = _check(q, k, cos, sin, positions)
    if v.shape != k.shape or write_pos.shape != (B, T) or slots.shape != (B,):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, write_pos {tuple(write_pos.shape)} and slots "
                         f"{tuple(slots.shape)} do not fit one batch")
    if len({q.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise TypeError("q, k, v and the caches must share one dtype")
    if k_cache.shape[1] != k_heads or k_cache.shape[3] != D or k_cache.stride(3) != 1 \
            or v_cache.shape != k_cache.shape or v_cache.stride(3) != 1:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be [slots, {k_heads}, "
                         f"max_len, {D}] with unit stride along the head dim")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B * T == 0:
        return q_out
    pdl = pdl_args(q)
    _rotary_store_kernel[(B * T, q_heads + k_heads)](
        q, k, v, q_out, k_cache, v_cache, slots, write_pos, cos, sin, positions, T, q_heads,
        *q.stride(), *k.stride(), *v.stride(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *write_pos.stride(), *positions.stride(),
        D, D // 2, HALF_BLOCK=triton.next_power_of_2(D // 2), num_warps=1, enable_fp_fusion=False, **pdl)
    return q_out
