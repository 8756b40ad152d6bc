"""A dense MLP block for a verify's few rows in two kernels: add + RMSNorm + gate/up + SiLU-and-mul + down.

At 4 rows (a chain 3/1/4's verify) the fused projections of eyas.kernels.fused_linear lose to cuBLAS (their
whole-row tiles hold a [rows, N, K] product in registers), so the block runs four kernels: the add and norm,
cuBLAS gate/up, SiLU-and-mul, cuBLAS down. Here one kernel splits the block along the intermediate
features instead of the outputs: program p normalises the rows (recomputed by every program; they are a
few KB), projects them onto its BLOCK_I gate and up rows with tensor-core dots (the rows padded to 16),
applies SiLU-and-mul, and multiplies by the matching BLOCK_I columns of the down weight, writing an fp32
partial output [rows, N]. A second kernel sums the partials in program order (deterministic) and rounds.
Each weight element is read once, by one program; the gate and up tiles' first chunk is loaded before the
PDL wait, so that load overlaps the kernel before.

Rounding follows the unfused torch ops: the residual add, the norm's two roundings, the gate/up output,
silu and the product each rounded to the tensor dtype (eyas.kernels.rounding). The products are summed in
fp32 in another order than cuBLAS's, so the output agrees with the unfused block to accumulation rounding.
fp32 dots run in IEEE precision, never TF32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from eyas.kernels import tile_choice
from eyas.kernels.fused_linear import _residual_chunk
from eyas.kernels.pdl import pdl_args, signal_dependents, wait_for_previous
from eyas.kernels.rounding import rounded

KERNEL_ROWS = 16   # rows the kernel takes: one tensor-core tile
MAX_K = 4096       # input features it takes (one chunked pass for the norm, one for the product)
_SUM_BLOCK = 128   # outputs per program of the partials' sum


def max_rows() -> int:
    """Rows up to which the layers run the block through these kernels: EYAS_FUSED_MLP_ROWS (a bench switch;
    0 is off), else 0 until measured on a GPU."""
    value = os.environ.get("EYAS_FUSED_MLP_ROWS")
    return min(int(value), KERNEL_ROWS) if value and value.isdigit() else 0


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b, accumulated in fp32. With DOT_F32 (fp32 inputs, or Triton's CPU interpreter, whose bf16
    dot is wrong in Triton 3.9) on fp32 copies of the operands at IEEE precision: a bf16 or fp16 product is
    exact in fp32, so this is the tensor cores' sum of exact products, in another order."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _mlp_parts_kernel(x_ptr, d_ptr, nw_ptr, gu_ptr, wd_ptr, h_ptr, part_ptr, M, K, I, N, eps,
                      HAS_DELTA: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    signal_dependents(USE_PDL)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    i_idx = (pid * BLOCK_I + tl.arange(0, BLOCK_I)).to(tl.int64)
    i_ok = i_idx < I
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    w_mask = i_ok[:, None] & (cols < K)[None, :]
    wg = tl.load(gu_ptr + i_idx[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
    wu = tl.load(gu_ptr + (I + i_idx)[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
    wait_for_previous(USE_PDL)
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h, offs, mask = _residual_chunk(x_ptr, d_ptr, rows, k0 + cols, M, K, HAS_DELTA)
        if HAS_DELTA:
            if pid == 0:
                tl.store(h_ptr + offs, h.to(dtype), mask=mask)
        sum_sq += tl.sum(h * h, axis=1)
    inv_rms = tl.rsqrt(sum_sq / K + eps)
    g = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h, offs, mask = _residual_chunk(x_ptr, d_ptr, rows, k0 + cols, M, K, HAS_DELTA)
        nw = tl.load(nw_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        xn = rounded(nw[None, :] * rounded(h * inv_rms[:, None], dtype), dtype).to(dtype)
        g = _dot(xn, tl.trans(wg), g, DOT_F32)
        u = _dot(xn, tl.trans(wu), u, DOT_F32)
        nxt = k0 + BLOCK_K + cols
        n_mask = i_ok[:, None] & (nxt < K)[None, :]
        wg = tl.load(gu_ptr + i_idx[:, None] * K + nxt[None, :], mask=n_mask, other=0.0)
        wu = tl.load(gu_ptr + (I + i_idx)[:, None] * K + nxt[None, :], mask=n_mask, other=0.0)
    g = rounded(g, dtype)
    silu = rounded(tl.div_rn(g, 1.0 + tl.exp(-g)), dtype)  # as eyas.kernels.activation
    act = rounded(silu * rounded(u, dtype), dtype).to(dtype)  # 0 in the padded rows and features
    out_cols = tl.arange(0, BLOCK_N)
    part_rows = part_ptr + pid * M * N + rows[:, None] * N
    for n0 in range(0, N, BLOCK_N):
        n_idx = n0 + out_cols
        wd = tl.load(wd_ptr + n_idx[None, :].to(tl.int64) * I + i_idx[:, None],
                     mask=i_ok[:, None] & (n_idx < N)[None, :], other=0.0)  # [BLOCK_I, BLOCK_N]
        part = _dot(act, wd, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_F32)
        tl.store(part_rows + n_idx[None, :], part, mask=(rows < M)[:, None] & (n_idx < N)[None, :])


@triton.jit
def _sum_parts_kernel(part_ptr, y_ptr, P, MN, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    signal_dependents(USE_PDL)
    wait_for_previous(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    parts = tl.arange(0, BLOCK_P)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + parts
        acc += tl.sum(tl.load(part_ptr + p[:, None] * MN + offs[None, :], mask=(p < P)[:, None] & ok[None, :],
                              other=0.0), axis=0)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs, rounded(acc, dtype).to(dtype), mask=ok)


# (BLOCK_I, BLOCK_K, BLOCK_N, warps); timed per shape at first use on a GPU by eyas.kernels.tile_choice.
CONFIGS = [triton.Config({"BLOCK_I": i, "BLOCK_K": k, "BLOCK_N": n}, num_warps=w)
           for i, k, n, w in ((16, 64, 64, 4), (16, 128, 64, 4), (32, 64, 64, 4), (32, 128, 64, 4),
                              (32, 128, 128, 4), (64, 64, 64, 4), (64, 128, 64, 8), (64, 128, 128, 8))]
_INTERPRETER_TILE = {"BLOCK_I": 32, "BLOCK_K": 64, "BLOCK_N": 64}  # the tests may set another
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _candidates() -> list:
    return CONFIGS


def norm_mlp(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
             gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + delta (x itself when delta is None), g, u = F.linear(RMSNorm(h), gate_up_weight).chunk(2),
    y = F.linear(silu(g) * u, down_weight). x [..., K]; gate_up_weight [2I, K] (gate rows, then up rows);
    down_weight [N, I]; all one dtype."""
    k = x.shape[-1]
    if x.dtype not in _DTYPES or {gate_up_weight.dtype, down_weight.dtype, norm_weight.dtype} != {x.dtype}:
        raise TypeError(f"norm_mlp: x {x.dtype} and every weight must share one of {_DTYPES}")
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[1] != k or gate_up_weight.shape[0] % 2:
        raise ValueError(f"norm_mlp: gate/up weight {tuple(gate_up_weight.shape)} is not [2I, {k}]")
    inter = gate_up_weight.shape[0] // 2
    if down_weight.dim() != 2 or down_weight.shape[1] != inter:
        raise ValueError(f"norm_mlp: down weight {tuple(down_weight.shape)} does not take {inter} features")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_mlp: norm weight {tuple(norm_weight.shape)} does not match {k} features")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"norm_mlp: delta {tuple(delta.shape)} must match x {tuple(x.shape)}")
    xr = x.reshape(-1, k).contiguous()
    m, n = xr.shape[0], down_weight.shape[0]
    if m > KERNEL_ROWS or k > MAX_K:
        raise ValueError(f"norm_mlp: {m} rows of {k} features exceed the {KERNEL_ROWS} x {MAX_K} it takes")
    dr = delta.reshape(-1, k).contiguous() if delta is not None else xr
    h = torch.empty_like(xr) if delta is not None else xr
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gu, wd, nw = gate_up_weight.contiguous(), down_weight.contiguous(), norm_weight.contiguous()
    pdl = pdl_args(xr)
    meta = dict(HAS_DELTA=delta is not None, DOT_F32=x.dtype == torch.float32 or not x.is_cuda,
                BLOCK_M=max(16, triton.next_power_of_2(m)), **pdl)

    def parts_for(tile) -> torch.Tensor:
        return torch.empty((triton.cdiv(inter, tile["BLOCK_I"]), m, n), dtype=torch.float32, device=x.device)

    def run(tile, weight, parts=None):
        parts = parts_for(tile.kwargs) if parts is None else parts
        _mlp_parts_kernel[(parts.shape[0],)](xr, dr, nw, weight, wd, h, parts, m, k, inter, n, eps, **tile.kwargs,
                                             num_warps=tile.num_warps, num_stages=tile.num_stages, **meta)
        return parts

    if x.is_cuda:
        key = ("_mlp_parts_kernel", m, k, inter, n, x.dtype, x.device, tuple(sorted(meta.items())))
        parts = run(tile_choice.choose(key, _candidates, run, gu), gu)
    else:  # Triton's CPU interpreter (tests): one tile
        parts = parts_for(_INTERPRETER_TILE)
        _mlp_parts_kernel[(parts.shape[0],)](xr, dr, nw, gu, wd, h, parts, m, k, inter, n, eps,
                                             **_INTERPRETER_TILE, **meta)
    block_p = min(64, triton.next_power_of_2(parts.shape[0]))
    _sum_parts_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](parts, y, parts.shape[0], m * n, BLOCK_P=block_p,
                                                         BLOCK=_SUM_BLOCK, num_warps=4, **pdl)
    return h.view(x.shape), y.view(*x.shape[:-1], n)
