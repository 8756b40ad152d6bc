"""Decode-shaped linears with the elementwise op before them fused in: one launch instead of two.

At batch 1 a decoder layer is a row of small launches; the projections that follow a norm or the gated
activation read an input of a few rows that the previous kernel just wrote. Two kernels fold that
previous kernel into the projection's input load:

- `norm_linear`: h = x + delta (the residual add), y = RMSNorm(h) @ W^T (+ bias). The norm is the one of
  eyas.kernels.norm, recomputed by every program from the whole rows (they are a few KB and in cache).
  Programs of the first column block also store h, the residual stream the next layer adds to.
- `silu_mul_linear`: y = (silu(gate) * up) @ W^T, the activation computed as the rows are loaded (and, for the
  EAGLE-3 draft, a residual added to y as it is stored).
- `linear_rows`: y = x @ W^T through the same tiles, for projections that no norm precedes.

Rounding follows torch's unfused ops (each intermediate rounded to the tensor dtype), so the projection's
input holds exactly the values the unfused kernels would write. The products are accumulated in fp32, in
another order than cuBLAS's, so outputs agree with `F.linear` to accumulation rounding, not bit for bit.

These are GEMVs for a few rows of small models, where each launch costs more than its arithmetic: one
program computes BLOCK_N outputs of every row, holding the rows whole ([M, K], K <= MAX_K) and a
[BLOCK_N, K] weight tile in registers: one load of each, one product, one reduction. Tensor-core tiles of
16 rows and a loop over rows both measured slower (benchmarks/bench_fused_linear.py); this layout wins at 1-2
rows and loses to cuBLAS from 4 rows on gate/up and down.

For a verify's 4-8 rows, whole rows leave room for small output tiles only, so hundreds of programs each
redo the rows' norm or activation. The kernels therefore also loop over K in chunks of 64 or 128 with
output tiles of up to 32 columns (the norm then takes a first pass over the rows for their sums of squares);
the warm-up's timing picks per shape among both kinds.

The kernels take at most MAX_K input features. Wider projections (an 8B model's 4,096 and 14,336) stay
with cuBLAS: fused through chunked tiles, they made the 8B-shaped decode step 16-18% slower (docs/kernels.md).

The kernels take up to KERNEL_ROWS rows; the layers fuse up to MAX_ROWS (NARROW_ROWS for narrow
projections): at 4 and 8 rows of SmolLM2's shapes the timing still chose whole-row tiles, which lost to
cuBLAS on gate/up and down, and a tree fell 18% with 8 rows fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels import tile_choice
from eyas.kernels.pdl import pdl_args, wait_for_previous
from eyas.kernels.rounding import rounded

KERNEL_ROWS = 8  # rows (tokens) the kernels take: up to a tree verify's 8
MAX_ROWS = 2     # rows up to which the layers fuse every projection: a verify's 4-8 rows fused lost (above)
MAX_K = 2048     # input features the kernels take and the layers fuse up to: wider ones stay with cuBLAS
NARROW_N = 1024  # output features up to which a projection counts as narrow (a small model's q/k/v, o_proj)
NARROW_ROWS = 8  # rows up to which narrow projections fuse: a verify of 4, 5, 8 rows replayed 5.5-8.5% faster


@triton.jit
def residual_chunk(x_ptr, d_ptr, rows, cols, M, K, HAS_DELTA: tl.constexpr):
    """fp32 values of h = x + delta (rounded as torch's add) at [rows, cols] of the [M, K] inputs, and the mask."""
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h = rounded(h + tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32), x_ptr.dtype.element_ty)
    return h, offs, mask


@triton.jit
def _norm_linear_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, h_ptr, y_ptr, M, N, K, eps,
                        HAS_NORM: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    n_idx = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    n_ok = n_idx < N
    if CHUNK_K == 0:  # whole rows: one load of each, one product, one reduction
        cols = tl.arange(0, BLOCK_K)
        col_ok = cols < K
        # The weights first: no kernel writes them, so with PDL their load overlaps the previous kernel.
        w = tl.load(w_ptr + n_idx[:, None] * K + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        wait_for_previous(USE_PDL)
        h, offs, mask = residual_chunk(x_ptr, d_ptr, rows, cols, M, K, HAS_DELTA)
        if HAS_DELTA:
            if pid_n == 0:
                tl.store(h_ptr + offs, h.to(dtype), mask=mask)
        if HAS_NORM:
            inv_rms = tl.rsqrt(tl.sum(h * h, axis=1) / K + eps)
            xn = rounded(nw[None, :] * rounded(h * inv_rms[:, None], dtype), dtype)
        else:
            xn = h
        y = tl.sum(xn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:  # K in chunks: a pass for the rows' sums of squares, then one for the product, weights a chunk ahead
        cols = tl.arange(0, CHUNK_K)
        w = tl.load(w_ptr + n_idx[:, None] * K + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :], other=0.0)
        wait_for_previous(USE_PDL)
        if HAS_NORM:  # the plain projection (HAS_NORM False) takes no delta: nothing to sum or store first
            sum_sq = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, CHUNK_K):
                h, offs, mask = residual_chunk(x_ptr, d_ptr, rows, k0 + cols, M, K, HAS_DELTA)
                if HAS_DELTA:
                    if pid_n == 0:
                        tl.store(h_ptr + offs, h.to(dtype), mask=mask)
                sum_sq += tl.sum(h * h, axis=1)
            inv_rms = tl.rsqrt(sum_sq / K + eps)
        y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, CHUNK_K):
            h, offs, mask = residual_chunk(x_ptr, d_ptr, rows, k0 + cols, M, K, HAS_DELTA)
            if HAS_NORM:
                nw = tl.load(nw_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                xn = rounded(nw[None, :] * rounded(h * inv_rms[:, None], dtype), dtype)
            else:
                xn = h
            y += tl.sum(xn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            nxt = k0 + CHUNK_K + cols
            w = tl.load(w_ptr + n_idx[:, None] * K + nxt[None, :], mask=n_ok[:, None] & (nxt < K)[None, :], other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + n_idx[None, :], y.to(dtype), mask=(rows < M)[:, None] & n_ok[None, :])


@triton.jit
def _silu_mul_chunk(gu_ptr, rows, cols, M, I):
    """silu(gate) * up at [rows, cols], rounded as torch's two ops (fp32 values)."""
    dtype: tl.constexpr = gu_ptr.dtype.element_ty
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    offs = rows[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + offs + I, mask=mask, other=0.0).to(tl.float32)
    silu = rounded(tl.div_rn(g, 1.0 + tl.exp(-g)), dtype)  # as eyas.kernels.activation
    return rounded(silu * up, dtype)


@triton.jit
def _silu_mul_linear_kernel(gu_ptr, w_ptr, y_ptr, r_ptr, M, N, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            USE_PDL: tl.constexpr):
    n_idx = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    n_ok = n_idx < N
    if CHUNK_K == 0:
        cols = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n_idx[:, None] * I + cols[None, :], mask=n_ok[:, None] & (cols < I)[None, :], other=0.0)
        wait_for_previous(USE_PDL)
        act = _silu_mul_chunk(gu_ptr, rows, cols, M, I)
        y = tl.sum(act[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        cols = tl.arange(0, CHUNK_K)
        w = tl.load(w_ptr + n_idx[:, None] * I + cols[None, :], mask=n_ok[:, None] & (cols < I)[None, :], other=0.0)
        wait_for_previous(USE_PDL)
        y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, CHUNK_K):
            act = _silu_mul_chunk(gu_ptr, rows, k0 + cols, M, I)
            y += tl.sum(act[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            nxt = k0 + CHUNK_K + cols
            w = tl.load(w_ptr + n_idx[:, None] * I + nxt[None, :], mask=n_ok[:, None] & (nxt < I)[None, :], other=0.0)
    dtype: tl.constexpr = gu_ptr.dtype.element_ty
    out = rows[:, None] * N + n_idx[None, :]
    out_ok = (rows < M)[:, None] & n_ok[None, :]
    y = rounded(y, dtype)  # to nearest, as a GPU's cast (the interpreter's cast truncates)
    if HAS_RESIDUAL:  # torch's `residual + y`: y rounded first, the sum rounded once
        y = rounded(tl.load(r_ptr + out, mask=out_ok, other=0.0).to(tl.float32) + y, dtype)
    tl.store(y_ptr + out, y.to(dtype), mask=out_ok)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# On a GPU the tile is timed at first use of each (rows, N, K) by eyas.kernels.tile_choice, which the engine's
# warm-up runs before any CUDA graph is captured: whole rows (CHUNK_K 0) with small output tiles, or K in
# chunks with wider ones.
CONFIGS = ([triton.Config({"BLOCK_N": n, "CHUNK_K": 0}, num_warps=w) for n in (2, 4, 8, 16) for w in (4, 8)]
           + [triton.Config({"BLOCK_N": n, "CHUNK_K": c}, num_warps=4) for n in (8, 16, 32) for c in (64, 128)])
PRODUCT_LIMIT = 65536  # rows x output columns x input columns of one product: every tile of 1-2 rows fits


def _prune(configs, named_args, limit: int = PRODUCT_LIMIT, **kwargs):
    """The tiles whose [rows, BLOCK_N, K or CHUNK_K] product is at most `limit`: the others spill registers
    by the kilobyte. Sized from the runtime arguments M and K (I), which every Triton version hands over in
    named_args."""
    m = triton.next_power_of_2(named_args["M"])
    k = triton.next_power_of_2(named_args["K"] if "K" in named_args else named_args["I"])
    fit = [c for c in configs
           if m * c.kwargs["BLOCK_N"] * (c.kwargs["CHUNK_K"] or k) <= limit and c.kwargs["CHUNK_K"] < k]
    return fit or configs[:1]


def _candidates(m: int, k: int) -> list:
    """The tiles timed for m rows of k input features (_prune over CONFIGS)."""
    return _prune(CONFIGS, {"M": m, "K": k})


def _check(what: str, x: torch.Tensor, weight: torch.Tensor, k: int):
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"{what}: input {x.dtype} and weight {weight.dtype} must be one of {_DTYPES}, equal")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{what}: weight {tuple(weight.shape)} does not take inputs of {k} features")
    rows = x.numel() // max(x.shape[-1], 1)
    if k > MAX_K:
        raise ValueError(f"{what}: {k} input features exceed the {MAX_K} it takes (wider projections stay with cuBLAS)")
    if rows > KERNEL_ROWS:
        raise ValueError(f"{what}: {rows} rows exceed the {KERNEL_ROWS} it takes")


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def _launch(kernel, m: int, n: int, k: int, weight_at: int, *args, **meta):
    """Launch `kernel` over args (args[weight_at] the weights) with the tile eyas.kernels.tile_choice picked
    for this kernel, switches and shape."""
    pdl = pdl_args(args[0])
    meta.update(BLOCK_M=triton.next_power_of_2(m), BLOCK_K=triton.next_power_of_2(k), **pdl)
    if not args[0].is_cuda:  # Triton's CPU interpreter (tests) steps through every program: the fewer, the faster
        kernel[(triton.cdiv(n, _INTERPRETER_BLOCK_N),)](*args, BLOCK_N=_INTERPRETER_BLOCK_N,
                                                        CHUNK_K=_INTERPRETER_CHUNK_K, **meta)
        return

    key = (kernel.fn.__name__, m, n, k, args[0].dtype, args[0].device, tuple(sorted(meta.items())))
    tile_choice.launch_chosen(kernel, key, lambda: _candidates(m, k), args, weight_at,
                              lambda tile: (triton.cdiv(n, tile.kwargs["BLOCK_N"]),), **meta)


def tile_for(kernel_name: str, m: int, n: int, k: int):
    """The tile picked for `kernel_name` ("_norm_linear_kernel" or "_silu_mul_linear_kernel") at m x n x k,
    or None before its first launch on a GPU (for reports)."""
    got = tile_choice.picked(lambda key: key[:4] == (kernel_name, m, n, k))
    return got[-1][1] if got else None


_INTERPRETER_BLOCK_N = 64
_INTERPRETER_CHUNK_K = 0  # whole rows; the tests set a chunk size to run the K loop


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
    _launch(_norm_linear_kernel, m, n, k, 3, xr, dr, norm_weight.contiguous(), weight.contiguous(), b, h, y, m, n, k,
            eps, HAS_NORM=True, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None)
    return h.view(x.shape), y.view(*x.shape[:-1], n)


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for a few rows, through the same tiles with no norm before them: for a projection
    that no norm precedes (the attention's output projection, the EAGLE-3 draft's q/k/v, fc and head)."""
    k = x.shape[-1]
    _check("linear_rows", x, weight, k)
    xr = _rows(x)
    m, n = xr.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w = weight.contiguous()
    _launch(_norm_linear_kernel, m, n, k, 3, xr, xr, w, w, w, xr, y, m, n, k, 0.0,
            HAS_NORM=False, HAS_DELTA=False, HAS_BIAS=False)
    return y.view(*x.shape[:-1], n)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) for gate, up = gate_up.chunk(2, dim=-1); weight [N, I]. With
    `residual` [..., N], residual + that (rounded as torch's two ops)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul_linear: the last dim of gate_up {tuple(gate_up.shape)} must be even")
    inter = gate_up.shape[-1] // 2
    _check("silu_mul_linear", gate_up, weight, inter)
    rows = _rows(gate_up)
    m, n = rows.shape[0], weight.shape[0]
    if residual is not None and (residual.shape != (*gate_up.shape[:-1], n) or residual.dtype != gate_up.dtype):
        raise ValueError(f"silu_mul_linear: residual {tuple(residual.shape)} {residual.dtype} must be "
                         f"{(*gate_up.shape[:-1], n)} {gate_up.dtype}")
    y = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    r = _rows(residual) if residual is not None else y
    _launch(_silu_mul_linear_kernel, m, n, inter, 1, rows, weight.contiguous(), y, r, m, n, inter,
            HAS_RESIDUAL=residual is not None)
    return y.view(*gate_up.shape[:-1], n)
