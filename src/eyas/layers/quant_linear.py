"""Linears whose weights stay in their shipped format and are unpacked on the fly: W4A16 and FP8 blocks.

Two formats (facts of the formats, as eyas.models.quant reads them):
- compressed-tensors pack-quantized int4: `weight` (the checkpoint's `weight_packed`) int32 [N, ceil(K/8)],
  value j of a word in bits 4j..4j+3, stored unsigned with an offset of 8; `weight_scale` [N, ceil(K/g)];
  asymmetric schemes add `weight_zero_point` int32 [ceil(N/8), ceil(K/g)], packed the same way along the output
  rows. w[n, k] = (q[n, k] - z[n, k // g]) * scale[n, k // g], with q and z the signed values (nibble - 8);
  symmetric: z = 0. A "channel" scheme is one group spanning the row (g = K).
- FP8 block quantization (DeepSeek-V3): `weight` float8_e4m3fn [N, K] and `weight_scale` (the checkpoint's
  `weight_scale_inv`, which multiplies) fp32 [ceil(N/br), ceil(K/bc)]: w = q * scale[n // br, k // bc].

`QuantFormat.dequantize` is the definition: each value computed in fp32 (exact for both formats) and rounded
once to the compute dtype, which is what loading a dequantized copy of the checkpoint in that dtype gives. The
reference matmul multiplies x by that dense weight, a row block at a time (whole, for small weights, so it
equals dequantize-then-matmul bit for bit); on CUDA, decode-sized inputs (<= MAX_ROWS rows) go through the
Triton kernel (eyas.kernels.w4a16), which unpacks inside the matmul and never writes the dense weight.

A quantized linear keeps `weight` as the name of its stored values (int32 or fp8), so the fused-projection
paths (eyas.layers.fused_linear), which take only weights of the activations' dtype, pass it by and call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.tensor_parallel import SINGLE, TPContext
from eyas.errors import EyasError
from eyas.kernels import enabled

FP8 = torch.float8_e4m3fn
MAX_ROWS = 16                 # rows up to which the kernel runs on CUDA (decode, verify of a few tokens)
DENSE_CHUNK = 1 << 24         # weights up to this many values are dequantized whole by the reference
SHIFTS = tuple(range(0, 32, 4))


@dataclass(frozen=True)
class QuantFormat:
    """method "int4" (group: 0 for one group per row; symmetric) or "fp8" (block: (rows, cols))."""

    method: str
    group: int = 0
    symmetric: bool = True
    block: tuple[int, int] = (128, 128)

    def groups(self, cols: int) -> int:
        return -(-cols // self.group_of(cols))

    def group_of(self, cols: int) -> int:
        return self.group or cols

    def piece_shapes(self, rows: int, cols: int) -> dict[str, tuple[int, int]]:
        """Stored tensors of an [rows, cols] weight: suffix -> shape (suffix "" is the values)."""
        if self.method == "fp8":
            br, bc = self.block
            return {"": (rows, cols), "_scale": (-(-rows // br), -(-cols // bc))}
        shapes = {"": (rows, -(-cols // 8)), "_scale": (rows, self.groups(cols))}
        if not self.symmetric:
            shapes["_zero_point"] = (-(-rows // 8), self.groups(cols))
        return shapes

    def units(self, cols: int) -> dict[str, tuple[int, int]]:
        """Suffix -> (rows, cols) of the weight one stored element covers: slices of the weight must align."""
        if self.method == "fp8":
            return {"": (1, 1), "_scale": self.block}
        g = self.group_of(cols)
        return {"": (1, 8), "_scale": (1, g), "_zero_point": (8, g)}

    def values_dtype(self) -> torch.dtype:
        return FP8 if self.method == "fp8" else torch.int32

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, cols: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """[..., rows, *] stored pieces -> the dense [..., rows, cols] weight in `dtype`."""
        if self.method == "fp8":
            br, bc = self.block
            rows = values.shape[-2]
            s = scale.float().repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
            return (values.float() * s).to(dtype)
        q = unpack_rows(values, cols)
        if zero is not None:
            z = unpack_cols(zero, values.shape[-2])
            q = q - z.repeat_interleave(self.group_of(cols), -1)[..., :cols]
        else:
            q = q - 8
        s = scale.float().repeat_interleave(self.group_of(cols), -1)[..., :cols]
        return (q.float() * s).to(dtype)


def unpack_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [..., R, W] of eight nibbles each -> int32 [..., R, cols] in 0..15 (value j in bits 4j..4j+3)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # the mask drops the arithmetic shift's sign bits
    return nibbles.flatten(-2)[..., :cols]


def unpack_cols(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [..., ceil(rows/8), G], packed along the rows -> int32 [..., rows, G] in 0..15."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None, :] >> shifts[:, None]) & 0xF  # [..., W, 8, G]
    return nibbles.flatten(-3, -2)[..., :rows, :]


def reference_matmul(x: torch.Tensor, fmt: QuantFormat, values, scale, zero, cols: int) -> torch.Tensor:
    """x [..., K] @ W^T with W dequantized to x's dtype; large weights a block of output rows at a time."""
    rows = values.shape[0]
    if rows * cols <= DENSE_CHUNK:
        return F.linear(x, fmt.dequantize(values, scale, zero, cols, x.dtype))
    unit = 8 * fmt.block[0] if fmt.method == "fp8" else 8  # blocks of rows whose pieces slice cleanly
    step = max(unit, DENSE_CHUNK // cols // unit * unit)
    outs = []
    for r in range(0, rows, step):
        zr = None if zero is None else zero[r // 8:(r + step) // 8]
        sr = scale[r // fmt.block[0]:(r + step) // fmt.block[0]] if fmt.method == "fp8" else scale[r:r + step]
        outs.append(F.linear(x, fmt.dequantize(values[r:r + step], sr, zr, cols, x.dtype)))
    return torch.cat(outs, -1)


def quant_matmul(x: torch.Tensor, fmt: QuantFormat, values, scale, zero, cols: int) -> torch.Tensor:
    """x [..., K] @ W^T: the Triton kernel for decode-sized inputs where kernels run, else the reference."""
    if x.numel() <= MAX_ROWS * x.shape[-1] and enabled(x, scale):
        from eyas.kernels.w4a16 import quant_linear_rows

        return quant_linear_rows(x.reshape(-1, cols), fmt, values, scale, zero).view(*x.shape[:-1], -1)
    return reference_matmul(x, fmt, values, scale, zero, cols)


class QuantLinear(nn.Module):
    """A linear with its weight in `fmt`: column-parallel (output blocks `out_sizes` split across ranks),
    row-parallel (input columns split, partial sums all-reduced) or "plain" (an nn.Linear, whole on every rank)."""

    quantized = True

    def __init__(self, fmt: QuantFormat, in_features: int, out_sizes: dict, bias: bool, parallel: str,
                 tp: TPContext = SINGLE, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fmt, self.parallel, self.tp = fmt, parallel, tp
        if parallel == "row":
            self.in_full, in_features = in_features, tp.shard(in_features, "input features")
            self.local = dict(out_sizes)
        else:
            self.in_full = in_features
            self.local = {k: tp.shard(n, f"output block {k}") if parallel == "column" else n
                          for k, n in out_sizes.items()}
        self.in_features = in_features
        self.offsets, off = {}, 0
        for k, n in self.local.items():
            self.offsets[k] = off
            off += n
        self.out_features = off
        shapes = fmt.piece_shapes(off, in_features)
        self.weight = nn.Parameter(torch.empty(shapes[""], dtype=fmt.values_dtype()), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(shapes["_scale"], dtype=scale_dtype), requires_grad=False)
        self.weight_zero_point = (nn.Parameter(torch.empty(shapes["_zero_point"], dtype=torch.int32),
                                               requires_grad=False) if "_zero_point" in shapes else None)
        self.bias = nn.Parameter(torch.empty(off)) if bias else None

    @classmethod
    def replacing(cls, linear: nn.Module, fmt: QuantFormat, scale_dtype: torch.dtype) -> "QuantLinear":
        """The quantized twin of a ColumnParallelLinear, RowParallelLinear or nn.Linear (same sharding)."""
        from eyas.layers.linear import ColumnParallelLinear, RowParallelLinear

        bias = linear.bias is not None
        if isinstance(linear, ColumnParallelLinear):
            sizes = {k: n * linear.tp.size for k, n in linear.local.items()}
            return cls(fmt, linear.weight.shape[1], sizes, bias, "column", linear.tp, scale_dtype)
        if isinstance(linear, RowParallelLinear):
            full_in = linear.weight.shape[1] * linear.tp.size
            return cls(fmt, full_in, {0: linear.weight.shape[0]}, bias, "row", linear.tp, scale_dtype)
        if isinstance(linear, nn.Linear):
            return cls(fmt, linear.in_features, {0: linear.out_features}, bias, "plain", SINGLE, scale_dtype)
        raise EyasError(f"cannot keep the weights of a {type(linear).__name__} quantized")

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's weight dequantized to `dtype` (latent attention absorbs kv_b_proj's into q and the output)."""
        return self.fmt.dequantize(self.weight, self.weight_scale, self.weight_zero_point, self.in_features, dtype)

    def forward(self, x):
        y = quant_matmul(x, self.fmt, self.weight, self.weight_scale, self.weight_zero_point, self.in_features)
        if self.parallel == "row":
            return self.finish(y)
        return y + self.bias if self.bias is not None else y

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(partial)
        return y + self.bias if self.bias is not None else y

    def load(self, param: str, tensor: torch.Tensor, shard=None):
        """A checkpoint piece (values, scale, zero point, or bias) of the full weight, or of fused block `shard`."""
        if param == "weight_shape":
            return self.check_shape(tensor, shard)
        if param == "bias":
            key = 0 if shard is None else shard
            n, off = self.local[key], self.offsets[key]
            part = tensor.narrow(0, self.tp.rank * n, n) if self.parallel == "column" else tensor
            return copy_piece(self.bias.data.narrow(0, off, n), part, "bias")
        suffix = param[len("weight"):]
        dst = getattr(self, param).data
        ur, uc = self.fmt.units(self.in_full)[suffix]
        if self.parallel == "row":
            c0, n = self.tp.rank * self.in_features, self.in_features
            per_row = suffix and self.fmt.method == "int4" and not self.fmt.group  # every column slice shares it
            return copy_piece(dst, tensor if per_row else take(tensor, -1, c0, n, uc, param), param)
        key = 0 if shard is None else shard
        n, off = self.local[key], self.offsets[key]
        r0 = self.tp.rank * n if self.parallel == "column" else 0
        src = take(tensor, -2, r0, n, ur, param)
        rows = dst.narrow(-2, *span(off, n, ur, dst.shape[-2], param)) if (off, n) != (0, self.out_features) else dst
        copy_piece(rows, src, f"{param}[{key}]")

    def check_shape(self, shape: torch.Tensor, shard=None):
        """The checkpoint's weight_shape must be the logical shape this layer expects of the (fused) block."""
        key = 0 if shard is None else shard
        rows = self.local[key] * (self.tp.size if self.parallel == "column" else 1)
        check_logical_shape(shape, (rows, self.in_full))


def span(start: int, n: int, unit: int, stored: int, what: str) -> tuple[int, int]:
    """Weight rows or columns [start, start + n) -> (start, length) in a piece whose elements cover `unit` each;
    a slice must start on a unit, and end on one unless it runs to the end of the weight (a ragged last unit)."""
    if start % unit:
        raise EyasError(f"{what}: a slice at {start} does not align with its {unit}-wide quantization blocks; "
                        "this sharding or fusion cannot keep the weight quantized")
    length = -(-n // unit)
    if n % unit and start // unit + length != stored:
        raise EyasError(f"{what}: a slice of {n} does not align with its {unit}-wide quantization blocks")
    return start // unit, length


def take(tensor: torch.Tensor, dim: int, start: int, n: int, unit: int, what: str) -> torch.Tensor:
    """The part of a checkpoint piece that covers weight rows/columns [start, start + n)."""
    if start == 0 and -(-n // unit) == tensor.shape[dim]:
        return tensor
    return tensor.narrow(dim, *span(start, n, unit, tensor.shape[dim], what))


def copy_piece(dst: torch.Tensor, src: torch.Tensor, what: str):
    if dst.shape != src.shape:
        raise EyasError(f"quantized weight piece {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if dst.dtype in (torch.int32, FP8) and src.dtype != dst.dtype:
        raise EyasError(f"quantized weight piece {what} is {src.dtype}, expected {dst.dtype}")
    dst.copy_(src)


def check_logical_shape(shape: torch.Tensor, want: tuple[int, int]):
    got = tuple(int(n) for n in shape.tolist())
    if got != want:
        raise EyasError(f"int4 weight_shape is {got}, expected {want}")


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight in `dtype`, dequantized if it is kept quantized."""
    return linear.dense_weight(dtype) if isinstance(linear, QuantLinear) else linear.weight.to(dtype)
