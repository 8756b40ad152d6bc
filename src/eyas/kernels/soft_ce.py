"""Soft cross-entropy against a teacher distribution, forward and backward, for EAGLE-3 training.

Per row of logits z (any float dtype) and teacher probabilities p (float32, summing to 1):
    ce = sum_v p_v * log_softmax(z)_v = p.z - logsumexp(z),   d ce / d z = p - softmax(z),
and the row's argmax (first occurrence on ties, as torch.argmax), which the accuracy needs.

Why a kernel: in torch each TTT step casts the [tokens, draft_vocab] logits to float32 and runs a
log-softmax, a product, a sum and an argmax over them, and the backward as many again: about 15 GB of
memory traffic per training step at 32k tokens x 8,192 (a profile showed elementwise products and copies as
the step's largest costs). Here the forward reads z and p once and writes three numbers per row; the
backward reads them once and writes the gradient in z's dtype.

One program per row; the row is read in BLOCK-wide chunks with a running max and sum per lane (online
logsumexp), so any vocabulary size works. Rows are addressed as [outer, inner] through two strides, so the
teacher's [B, T - 1 - k, V] slices of a [B, T, V] tensor are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _row_ptrs(z_ptr, p_ptr, inner, z_outer, z_inner, p_outer, p_inner):
    """This program's row (grid axis 0), and where it starts in z and in p."""
    row = tl.program_id(0).to(tl.int64)
    outer, rest = row // inner, row % inner
    return row, z_ptr + outer * z_outer + rest * z_inner, p_ptr + outer * p_outer + rest * p_inner


@triton.jit
def _soft_ce_fwd_kernel(z_ptr, p_ptr, ce_ptr, lse_ptr, top_ptr, inner, z_outer, z_inner, p_outer, p_inner, V,
                        BLOCK: tl.constexpr):
    row, z_row, p_row = _row_ptrs(z_ptr, p_ptr, inner, z_outer, z_inner, p_outer, p_inner)
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)   # running max per lane
    s = tl.zeros([BLOCK], tl.float32)                  # running sum of exp(z - m) per lane
    pz = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
        new_m = tl.maximum(m, z)
        alpha = tl.where(m == new_m, 1.0, tl.exp(m - new_m))
        s = s * alpha + tl.where(mask, tl.exp(z - new_m), 0.0)
        m = new_m
        pz += tl.where(mask, p * z, 0.0)
        better = z > best  # strict: a lane keeps its first (lowest-index) maximum
        best_i = tl.where(better, cols.to(tl.int64), best_i)
        best = tl.where(better, z, best)
    row_max = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    lse = row_max + tl.log(total)
    tl.store(ce_ptr + row, tl.sum(pz, axis=0) - lse)
    tl.store(lse_ptr + row, lse)
    top = tl.max(best, axis=0)
    tl.store(top_ptr + row, tl.min(tl.where(best == top, best_i, V), axis=0))


@triton.jit
def _soft_ce_bwd_kernel(z_ptr, p_ptr, lse_ptr, g_ptr, dz_ptr, inner, z_outer, z_inner, p_outer, p_inner, V,
                        BLOCK: tl.constexpr):
    row, z_row, p_row = _row_ptrs(z_ptr, p_ptr, inner, z_outer, z_inner, p_outer, p_inner)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
        dz = g * (p - tl.exp(z - lse))
        tl.store(dz_ptr + row * V + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor):
    """[outer, inner, V] addressing of a 3-D tensor whose last dimension is contiguous."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"soft_ce expects [B, T, V] tensors with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.stride(0), x.stride(1)


def soft_ce_forward(z: torch.Tensor, p: torch.Tensor):
    """z: [B, T, V] logits; p: [B, T, V] probabilities. Returns ce [B, T] fp32, lse [B, T] fp32, argmax [B, T]."""
    if z.shape != p.shape:
        raise ValueError(f"logits {tuple(z.shape)} and probabilities {tuple(p.shape)} differ in shape")
    B, T, V = z.shape
    ce = torch.empty(B, T, dtype=torch.float32, device=z.device)
    lse, top = torch.empty_like(ce), torch.empty(B, T, dtype=torch.long, device=z.device)
    if B * T:
        _soft_ce_fwd_kernel[(B * T,)](z, p, ce, lse, top, T, *_rows(z), *_rows(p), V, BLOCK=BLOCK)
    return ce, lse, top


def soft_ce_backward(z: torch.Tensor, p: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d(grad . ce)/dz = grad * (p - softmax(z)), in z's dtype, contiguous [B, T, V]."""
    B, T, V = z.shape
    dz = torch.empty(B, T, V, dtype=z.dtype, device=z.device)
    if B * T:
        _soft_ce_bwd_kernel[(B * T,)](z, p, lse.contiguous(), grad.float().contiguous(), dz, T, *_rows(z),
                                      *_rows(p), V, BLOCK=BLOCK)
    return dz
