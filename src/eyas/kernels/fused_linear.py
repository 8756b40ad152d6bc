"""Decode-shaped linears with the elementwise op before them fused in: one launch instead of two.

At batch 1 a decoder layer is a row of small launches; the projections that follow a norm or the gated
activation read an input of a few rows that the previous kernel just wrote. Two kernels fold that
previous kernel into the projection's input load:

- `norm_linear`: h = x + delta (the residual add), y = RMSNorm(h) @ W^T (+ bias). The norm is the one of
  eyas.kernels.norm, recomputed by every program from the whole rows (they are a few KB and in cache).
  Programs of the first column block also store h, the residual stream the next layer adds to.
- `silu_mul_linear`: y = (silu(gate) * up) @ W^T, the activation recomputed tile by tile as it is loaded.

Rounding follows torch's unfused ops (each intermediate rounded to the tensor dtype), so the projection's
input holds exactly the values the unfused kernels would write. The products are exact and accumulated in fp32
(`tl.dot`; IEEE for fp32 inputs: no TF32), in another order than cuBLAS's, so outputs agree with
`F.linear` to accumulation rounding, not bit for bit.

Tiles: BLOCK_M = 16 rows (tl.dot's minimum; decode rows are fewer and masked); BLOCK_K set by K; the
output features per program (BLOCK_N) and the pipeline depth timed per shape on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.rounding import rounded

MAX_ROWS = 16  # rows (tokens) up to which the fused path runs; more rows are a GEMM's job (cuBLAS)
_BLOCK_M = 16


@triton.jit
def _h_tile(x_ptr, d_ptr, rows, cols, mask, K, HAS_DELTA: tl.constexpr):
    """fp32 values of h = x (+ delta, summed in fp32 and rounded to x's dtype) for a [rows, cols] tile."""
    offs = rows[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + offs, mask=mask, other=0.0)
        h = rounded(h + d.to(tl.float32), x.dtype)
    return h


@triton.jit
def _accumulate(acc, a, w, IEEE: tl.constexpr, NATIVE: tl.constexpr):
    """acc + a @ w^T, with a's fp32 values (already rounded to the input dtype) and w's [N, K] tile, products
    exact and summed in fp32 either way: fp32 runs IEEE (never TF32); bf16 and fp16 run on their own tensor
    cores (NATIVE, on a GPU) or as fp32 values, exact in TF32 (Triton's CPU interpreter computes no bf16 dot)."""
    if IEEE:
        return acc + tl.dot(a, tl.trans(w), input_precision="ieee")
    if NATIVE:
        return acc + tl.dot(a.to(w.dtype), tl.trans(w))
    return acc + tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="tf32")


@triton.jit
def _norm_linear_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, h_ptr, y_ptr, M, N, K, eps,
                        HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, NATIVE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # n * K can pass 2^31 in large models
    row_ok, n_ok = rows < M, n_idx < N
    dtype = x_ptr.dtype.element_ty

    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        h = _h_tile(x_ptr, d_ptr, rows, cols, row_ok[:, None] & (cols < K)[None, :], K, HAS_DELTA)
        sum_sq += tl.sum(h * h, axis=1)
    inv_rms = tl.rsqrt(sum_sq / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        mask = row_ok[:, None] & col_ok[None, :]
        h = _h_tile(x_ptr, d_ptr, rows, cols, mask, K, HAS_DELTA)
        if HAS_DELTA:
            if pid_n == 0:
                tl.store(h_ptr + rows[:, None] * K + cols[None, :], h.to(dtype), mask=mask)
        normed = rounded(h * inv_rms[:, None], dtype)
        nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        xn = rounded(nw[None, :] * normed, dtype)
        w = tl.load(w_ptr + n_idx[:, None] * K + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _accumulate(acc, xn, w, IEEE, NATIVE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + n_idx[None, :], acc.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _silu_mul_linear_kernel(gu_ptr, w_ptr, y_ptr, M, N, I, IEEE: tl.constexpr, NATIVE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok, n_ok = rows < M, n_idx < N
    dtype = gu_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < I
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * (2 * I) + cols[None, :]
        g = tl.load(gu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + offs + I, mask=mask, other=0.0).to(tl.float32)
        silu = rounded(tl.div_rn(g, 1.0 + tl.exp(-g)), dtype)  # as eyas.kernels.activation
        act = rounded(silu * up, dtype)
        w = tl.load(w_ptr + n_idx[:, None] * I + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _accumulate(acc, act, w, IEEE, NATIVE)
    tl.store(y_ptr + rows[:, None] * N + n_idx[None, :], acc.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_k(k: int) -> int:
    """K per loop step. Fixed by K alone (not tuned): it sets the order in which products are summed, so
    every process and every tile choice computes the same bits."""
    return 128 if k >= 2048 else 64


# On a GPU the output tile and pipeline depth are timed at first use of each (N, K), which the engine's
# warm-up runs before any CUDA graph is captured; the interpreter (CPU tests) takes the first config.
_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=4, num_stages=s) for n in (16, 32, 64, 128) for s in (2, 4)]
_tuned = {
    _norm_linear_kernel: triton.autotune(_CONFIGS, key=["N", "K"])(_norm_linear_kernel),
    _silu_mul_linear_kernel: triton.autotune(_CONFIGS, key=["N", "I"])(_silu_mul_linear_kernel),
}


def _check(what: str, x: torch.Tensor, weight: torch.Tensor, k: int):
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"{what}: input {x.dtype} and weight {weight.dtype} must be one of {_DTYPES}, equal")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{what}: weight {tuple(weight.shape)} does not take inputs of {k} features")


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def _launch(kernel, m: int, n: int, k: int, *args, **meta):
    rows = triton.cdiv(m, _BLOCK_M)
    meta.update(IEEE=args[0].dtype == torch.float32, NATIVE=args[0].is_cuda)
    if args[0].is_cuda:
        _tuned[kernel][lambda c: (triton.cdiv(n, c["BLOCK_N"]), rows)](*args, BLOCK_M=_BLOCK_M,
                                                                       BLOCK_K=_block_k(k), **meta)
    else:
        block_n = _CONFIGS[0].kwargs["BLOCK_N"]
        kernel[(triton.cdiv(n, block_n), rows)](*args, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_block_k(k),
                                                 num_warps=4, **meta)


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + delta (x itself when delta is None), y = F.linear(RMSNorm(h), weight, bias).
    x [..., K]; weight [N, K]; all one dtype. Returns new contiguous tensors (h is x when delta is None)."""
    k = x.shape[-1]
    _check("norm_linear", x, weight, k)
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_linear: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not "
                         f"match x {tuple(x.shape)} {x.dtype}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"norm_linear: delta {tuple(delta.shape)} {delta.dtype} must match x {tuple(x.shape)}")
    xr = _rows(x)
    m, n = xr.shape[0], weight.shape[0]
    dr = _rows(delta) if delta is not None else xr
    h = torch.empty_like(xr) if delta is not None else xr
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight
    _launch(_norm_linear_kernel, m, n, k, xr, dr, norm_weight.contiguous(), weight.contiguous(), b, h, y, m, n, k,
            eps, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None)
    return h.view(x.shape), y.view(*x.shape[:-1], n)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) for gate, up = gate_up.chunk(2, dim=-1); weight [N, I]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul_linear: the last dim of gate_up {tuple(gate_up.shape)} must be even")
    inter = gate_up.shape[-1] // 2
    _check("silu_mul_linear", gate_up, weight, inter)
    rows = _rows(gate_up)
    m, n = rows.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    _launch(_silu_mul_linear_kernel, m, n, inter, rows, weight.contiguous(), y, m, n, inter)
    return y.view(*gate_up.shape[:-1], n)
