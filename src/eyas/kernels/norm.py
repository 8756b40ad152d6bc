"""Fused RMSNorm, and a residual add fused with the RMSNorm that follows it.

RMSNorm in torch launches about eight kernels (cast, square, mean, add eps, rsqrt, scale, cast, weight);
at batch 1 each of them costs a launch and almost no arithmetic, so one kernel per norm (one per residual
add and norm) removes most of a decoder layer's small launches. The meaning is eyas.layers.norm.RMSNorm:
normalise in fp32, round to the input dtype, then multiply by the weight in torch's promoted dtype
(computed in fp32 and rounded once, which is how torch rounds bf16 * bf16).

One program normalises one row of N elements, held whole in registers (BLOCK = next power of two of N).
Rows are addressed through two strides, so views such as Qwen3's per-head q/k [B, T, heads, D] sliced out
of a fused qkv projection are read in place, without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous
from eyas.kernels.rounding import rounded

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _normalise(x32, dtype: tl.constexpr, w_ptr, y_ptr, cols, mask, n_cols, eps):
    """RMSNorm.forward of one row (fp32 values of a `dtype` row), stored at y_ptr in y's dtype. Returns the
    row's 1 / rms."""
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = rounded(x32 * inv_rms, dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = y_ptr.dtype.element_ty
    tl.store(y_ptr + cols, rounded(w * normed, out_dtype).to(out_dtype), mask=mask)
    return inv_rms


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, inner_rows, x_outer_stride, x_inner_stride, n_cols, eps,
                     BLOCK: tl.constexpr, SAVE_RSTD: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // inner_rows) * x_outer_stride + (row % inner_rows) * x_inner_stride
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    inv_rms = _normalise(x.to(tl.float32), x.dtype, w_ptr, y_ptr + row * n_cols, cols, mask, n_cols, eps)
    if SAVE_RSTD:
        tl.store(rstd_ptr + row, inv_rms)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """The backward of RMSNorm.forward's torch ops for ROWS contiguous rows: dx per row, and this program's
    partial sum of dw (summed over programs by the caller). With n = x * r and g = dy * w rounded to x's
    dtype (the gradient of the rounded `normed`): dx = r * (g - n * mean(g * n)), dw = sum dy * round(n)."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < n_rows:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
            dtype = x.dtype
            r = tl.load(rstd_ptr + row)
            n = x.to(tl.float32) * r
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            g = rounded(dy * w, dtype).to(tl.float32)
            dot = tl.sum(g * n, axis=0) / n_cols
            dx = r * (g - n * dot)
            tl.store(dx_ptr + row * n_cols + cols, rounded(dx, dtype).to(dtype), mask=mask)
            dw += dy * rounded(n, dtype).to(tl.float32)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, inner_rows, x_outer_stride, x_inner_stride,
                         d_outer_stride, d_inner_stride, n_cols, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // inner_rows, row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * x_outer_stride + inner * x_inner_stride + cols, mask=mask, other=0.0)
    d = tl.load(d_ptr + outer * d_outer_stride + inner * d_inner_stride + cols, mask=mask, other=0.0)
    h = rounded(x.to(tl.float32) + d.to(tl.float32), x.dtype)  # torch's `x + delta`: fp32 sum, rounded once
    tl.store(h_ptr + row * n_cols + cols, h.to(x.dtype), mask=mask)
    _normalise(h, x.dtype, w_ptr, y_ptr + row * n_cols, cols, mask, n_cols, eps)


@triton.jit
def _rms_norm_pair_kernel(a_ptr, b_ptr, wa_ptr, wb_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """Row `row` of cat([RMSNorm_a(a), RMSNorm_b(b)], -1): program (row, 0) norms a's row into the first half,
    (row, 1) b's into the second."""
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if tl.program_id(1) == 0:
        x = tl.load(a_ptr + row * n_cols + cols, mask=mask, other=0.0)
        _normalise(x.to(tl.float32), x.dtype, wa_ptr, y_ptr + row * 2 * n_cols, cols, mask, n_cols, eps)
    else:
        x = tl.load(b_ptr + row * n_cols + cols, mask=mask, other=0.0)
        _normalise(x.to(tl.float32), x.dtype, wb_ptr, y_ptr + row * 2 * n_cols + n_cols, cols, mask, n_cols, eps)


def _row_layout(*tensors: torch.Tensor):
    """The rows of same-shaped [..., N] tensors as an (outer, inner) grid of rows: leading dims that every
    tensor lays out back to back are merged; when more than two groups remain, or the last dim is strided,
    the tensors are copied contiguous. Returns the tensors, the inner row count and each tensor's
    (outer, inner) row strides."""
    if any(t.stride(-1) != 1 for t in tensors):
        tensors = tuple(t.contiguous() for t in tensors)
    groups: list[tuple[int, list[int]]] = []  # (rows, each tensor's stride between them)
    for dim, size in enumerate(tensors[0].shape[:-1]):
        if size == 1:
            continue
        strides = [t.stride(dim) for t in tensors]
        if groups and all(prev == size * s for prev, s in zip(groups[-1][1], strides)):
            groups[-1] = (groups[-1][0] * size, strides)
        else:
            groups.append((size, strides))
    if len(groups) > 2:
        return _row_layout(*(t.contiguous() for t in tensors))
    groups = [(1, [0] * len(tensors))] * (2 - len(groups)) + groups
    (_, outer), (inner_rows, inner) = groups
    return tensors, inner_rows, list(zip(outer, inner))


def _check(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise TypeError(f"rms_norm supports {_DTYPES}, got x {x.dtype} and weight {weight.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if x.shape[-1] > 65536:
        raise ValueError(f"rows of {x.shape[-1]} elements do not fit one program (at most 65536)")
    return torch.promote_types(weight.dtype, x.dtype)  # the dtype of torch's `weight * normed`


def _launch_options(n_cols: int) -> dict:
    block = triton.next_power_of_2(n_cols)
    return {"BLOCK": block, "num_warps": min(max(block // 256, 1), 16)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) with `weight` over the last dim; returns a new contiguous tensor of x's shape in the dtype
    torch gives `weight * x` (x.dtype when the weight matches it)."""
    return _rms_norm(x, weight, eps, save_rstd=False)[0]


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm, also returning each row's 1 / rms (float32 [rows]) for the backward."""
    return _rms_norm(x, weight, eps, save_rstd=True)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, save_rstd: bool):
    out_dtype = _check(x, weight)
    n_cols = x.shape[-1]
    (x,), inner_rows, [(x_outer, x_inner)] = _row_layout(x)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // n_cols
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if save_rstd else None
    pdl = pdl_args(x)
    _rms_norm_kernel[(rows,)](x, weight.contiguous(), y, y if rstd is None else rstd, inner_rows, x_outer, x_inner,
                              n_cols, eps, SAVE_RSTD=save_rstd, **pdl, **_launch_options(n_cols))
    return y, rstd


BWD_ROWS = 32  # rows per backward program: each keeps one partial dw row


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in the weight's dtype) for rms_norm_train's output gradient dy; x and dy
    contiguous."""
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols
    programs = triton.cdiv(rows, BWD_ROWS)
    dx = torch.empty_like(x)
    partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](x, weight.contiguous(), rstd, dy, dx, partial, rows, n_cols,
                                      ROWS=BWD_ROWS, **_launch_options(n_cols))
    return dx, partial.sum(0).to(weight.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + delta (rounded to x.dtype), y = RMSNorm(h) with `weight`, in one kernel. Returns new contiguous
    (h, y); y's dtype follows rms_norm's rule."""
    out_dtype = _check(x, weight)
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} must match x {tuple(x.shape)} {x.dtype}")
    n_cols = x.shape[-1]
    (x, delta), inner_rows, [(x_outer, x_inner), (d_outer, d_inner)] = _row_layout(x, delta)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // n_cols
    pdl = pdl_args(x)
    _add_rms_norm_kernel[(rows,)](x, delta, weight.contiguous(), h, y, inner_rows, x_outer, x_inner,
                                  d_outer, d_inner, n_cols, eps, **pdl, **_launch_options(n_cols))
    return h, y


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """torch.cat([rms_norm(a, weight_a), rms_norm(b, weight_b)], -1) in one launch (the EAGLE-3 draft's input:
    its normed token embeddings beside its normed hidden state). a and b share shape and dtype, and the two
    weights a dtype."""
    out_dtype = _check(a, weight_a)
    if b.shape != a.shape or b.dtype != a.dtype or weight_b.shape != weight_a.shape or weight_b.dtype != weight_a.dtype:
        raise ValueError(f"rms_norm_pair: b {tuple(b.shape)} {b.dtype} and its weight must match a's "
                         f"{tuple(a.shape)} {a.dtype}")
    n_cols = a.shape[-1]
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty((*a.shape[:-1], 2 * n_cols), dtype=out_dtype, device=a.device)
    rows = a.numel() // max(n_cols, 1)
    if rows:
        _rms_norm_pair_kernel[(rows, 2)](a, b, weight_a.contiguous(), weight_b.contiguous(), y, n_cols, eps,
                                         **pdl_args(a), **_launch_options(n_cols))
    return y
