"""x @ W^T with W kept packed (int4 pack-quantized, or FP8 blocks), unpacked inside the matmul: W4A16 / W8A16.

The layer (eyas.layers.quant_linear) defines the formats and the meaning: W dequantized to the activations'
dtype (each value computed in fp32 and rounded once), then the matmul. This kernel computes each tile of W that
way in registers, rounds it to x's dtype as the reference does, and accumulates in fp32, so it differs from
the reference only in the order of the sums. It reads each weight byte once per tile of rows, never writing a
dense W: at decode the cost is the packed bytes (a quarter of bf16's for int4).

Two shapes of launch:
- dense rows (a linear at decode): a program takes BLOCK_M = 16 rows and BLOCK_N outputs and walks K with
  tl.dot, so up to 16 rows read the weights once. Triton's CPU interpreter gets a bf16 tl.dot wrong (numpy
  has no bf16), so off CUDA the dot takes fp32 copies: the same products (a bf16 times a bf16 is exact in
  fp32) summed in fp32, as the GPU's bf16 dot sums them;
- expert rows (routed experts): each row carries its expert id, a program takes one row and BLOCK_N of that
  expert's outputs (the copies of a decode batch seldom share an expert).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.rounding import rounded

INT4, INT4_ZERO, FP8 = 0, 1, 2


@triton.jit
def _quant_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, out_ptr, M, N, K, x_stride, w_stride_e, w_stride_n,
                       s_stride_e, s_stride_n, z_stride_e, z_stride_n, group, block_r, block_c,
                       FMT: tl.constexpr, HAS_IDS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    row_ok = rows < M
    col_ok = cols < N
    w_base = w_ptr
    s_base = s_ptr
    z_base = z_ptr
    if HAS_IDS:  # BLOCK_M == 1: this row's expert
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        w_base += e * w_stride_e
        s_base += e * s_stride_e
        z_base += e * z_stride_e
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = col_ok[:, None] & k_ok[None, :]
        if FMT == 2:
            q = tl.load(w_base + cols[:, None].to(tl.int64) * w_stride_n + ks[None, :], mask=w_ok, other=0.0)
            s = tl.load(s_base + (cols // block_r)[:, None] * s_stride_n + (ks // block_c)[None, :], mask=w_ok,
                        other=0.0)
            w = q.to(tl.float32) * s.to(tl.float32)
        else:
            words = tl.load(w_base + cols[:, None].to(tl.int64) * w_stride_n + (ks // 8)[None, :], mask=w_ok,
                            other=0)
            q = (words >> ((ks % 8) * 4)[None, :]) & 0xF  # the mask drops the arithmetic shift's sign bits
            if FMT == 1:
                zw = tl.load(z_base + (cols // 8)[:, None] * z_stride_n + (ks // group)[None, :], mask=w_ok, other=0)
                z = (zw >> ((cols % 8) * 4)[:, None]) & 0xF
            else:
                z = 8
            s = tl.load(s_base + cols[:, None] * s_stride_n + (ks // group)[None, :], mask=w_ok, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
        w = rounded(w, x_dtype)  # the dequantized weight as the reference holds it: exact in x's dtype
        if HAS_IDS:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        elif x_dtype == tl.float32 or FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x_dtype)))
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, rounded(acc, x_dtype).to(x_dtype), mask=row_ok[:, None] & col_ok[None, :])


def quant_linear_rows(x: torch.Tensor, fmt, values: torch.Tensor, scale: torch.Tensor,
                      zero: torch.Tensor | None = None, expert_ids: torch.Tensor | None = None,
                      block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype. W in `fmt` (a layers.quant_linear.QuantFormat): values [N, *],
    or [E, N, *] with `expert_ids` [M] naming row m's expert; scale and zero point alike."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be a 2-D fp32/bf16/fp16 tensor, got {x.dtype} {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, K = x.shape
    stacked = expert_ids is not None
    if values.dim() != (3 if stacked else 2):
        raise ValueError(f"values {tuple(values.shape)} must be {'[E, N, *] with expert ids' if stacked else '[N, *]'}")
    N = values.shape[-2]
    want = K if fmt.method == "fp8" else -(-K // 8)
    if values.shape[-1] != want:
        raise ValueError(f"values {tuple(values.shape)} do not hold {K} input features in format {fmt.method}")
    values, scale = values.contiguous(), scale.contiguous()
    code = FP8 if fmt.method == "fp8" else INT4 if zero is None else INT4_ZERO
    zero = zero.contiguous() if zero is not None else scale  # unused by the kernel when there are no zero points
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ids = expert_ids.to(torch.int32).contiguous() if stacked else out  # unused without HAS_IDS
    block_m = 1 if stacked else 16
    block_n = block_n or (32 if stacked else 64)
    block_k = block_k or (128 if stacked else 64)
    e_strides = [t.stride(0) if stacked else 0 for t in (values, scale, zero)]
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _quant_rows_kernel[grid](
        x, values, scale, zero, ids, out, M, N, K, x.stride(0), e_strides[0], values.stride(-2),
        e_strides[1], scale.stride(-2), e_strides[2], zero.stride(-2), fmt.group_of(K), fmt.block[0], fmt.block[1],
        FMT=code, HAS_IDS=stacked, FP32_DOT=not x.is_cuda, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4)
    return out
