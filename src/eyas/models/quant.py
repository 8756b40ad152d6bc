"""Quantized checkpoints as shipped, kept quantized in the model: which modules ship packed, and their twins.

Two formats:
- FP8 block quantization (DeepSeek-V3): `X.weight` float8_e4m3fn [out, in] and `X.weight_scale_inv` fp32
  [ceil(out/br), ceil(in/bc)]; despite its name the scale multiplies: w = q * scale[i // br, j // bc].
- compressed-tensors pack-quantized int4 (Kimi-K2): `X.weight_packed` int32 [out, ceil(in/8)] holding eight
  4-bit values per int32, value j of a word in bits 4j..4j+3 (column 8p + j of the row), each stored
  unsigned with an offset of 8; `X.weight_scale` [out, ceil(in/group)]; `X.weight_shape` [2]; asymmetric
  schemes add `X.weight_zero_point` int32 [ceil(out/8), ceil(in/group)], packed the same way down the rows.
  w = (q - z) * scale[i, j // group] with q, z the signed values (nibble - 8); symmetric: z = 0.

`quantized_modules` reads only the safetensors headers to learn which modules ship packed (a piece left
without its partners is an error naming it); `keep_quantized` swaps those modules of the meta-built model for
their quantized twins before anything is allocated, so the model holds the packed bytes and never a dense
copy. `dequantize_fp8` / `dequantize_int4` are the formats' definitions written out (tests compare against
them), and `quantize_fp8_blocks` / `pack_int4_groups` write these layouts, for tests and small checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eyas.errors import EyasError
from eyas.layers.quant_linear import QuantFormat, QuantLinear, unpack_cols, unpack_rows
from eyas.models.moe import Experts
from eyas.models.quant_experts import QuantExperts

FP8 = torch.float8_e4m3fn
# checkpoint piece -> the suffix our quantized modules store it under ("" the values; _shape is checked only)
PIECE_SUFFIX = {"weight": "", "weight_packed": "", "weight_scale": "_scale", "weight_scale_inv": "_scale",
                "weight_zero_point": "_zero_point", "weight_shape": "_shape"}
# method -> (pieces a quantized module must ship, pieces it may ship)
NEEDED = {"fp8": (("weight", "weight_scale_inv"), ()),
          "int4": (("weight_packed", "weight_scale"), ("weight_shape",))}
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": FP8, "F8_E5M2": torch.float8_e5m2}


def quant_format(quant: dict) -> QuantFormat:
    if quant["method"] == "fp8":
        return QuantFormat("fp8", block=tuple(quant["block"]))
    return QuantFormat("int4", group=quant.get("group_size") or 0, symmetric=quant.get("symmetric", True))


def read_header(path: Path) -> dict:
    """A safetensors file's header: key -> {"dtype", "shape", "data_offsets"}, without reading any tensor."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        return header
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise EyasError(f"cannot read {path.name}: corrupted or not a safetensors file ({e})") from None


def quantized_modules(files: list[Path], quant: dict, skip=lambda key: False) -> dict[str, torch.dtype]:
    """Checkpoint module name -> dtype of its scales, for every module that ships quantized."""
    method = quant["method"]
    needed, optional = NEEDED[method]
    if not quant.get("symmetric", True):
        needed = needed + ("weight_zero_point",)
    pieces: dict[str, dict[str, str]] = {}
    for f in files:
        for key, info in read_header(f).items():
            module, _, piece = key.rpartition(".")
            if skip(key) or piece not in needed + optional:
                continue
            if piece == "weight" and not info["dtype"].startswith("F8_"):
                continue  # a dense weight
            pieces.setdefault(module, {})[piece] = info["dtype"]
    incomplete = [(m, got) for m, got in pieces.items() if any(n not in got for n in needed)]
    if incomplete:
        module, got = incomplete[0]
        missing = next(n for n in needed if n not in got)
        raise EyasError(f"checkpoint has {module}.{next(iter(got))} but not {module}.{missing}"
                        + (f" ({len(incomplete) - 1} more incomplete weights)" if len(incomplete) > 1 else ""))
    if method == "fp8" and any(got["weight"] != "F8_E4M3" for got in pieces.values()):
        raise EyasError("fp8 weights must be float8_e4m3fn (F8_E4M3)")
    scale = "weight_scale_inv" if method == "fp8" else "weight_scale"
    return {m: SAFETENSORS_DTYPES[got[scale]] for m, got in pieces.items()}


def keep_quantized(model: nn.Module, modules: dict[str, torch.dtype], quant: dict, prefix_map, dtype: torch.dtype):
    """Swap each module that ships quantized (checkpoint names, mapped by `prefix_map`) for its quantized twin,
    on the meta device; fused modules (q/k/v, gate/up, stacked experts) must ship quantized in every part."""
    fmt = quant_format(quant)
    targets: dict[str, set] = {}
    for ckpt_module, scale_dtype in modules.items():
        name, _, _ = prefix_map(f"{ckpt_module}.weight")
        targets.setdefault(name, set()).add(scale_dtype)
    for name, scale_dtypes in targets.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise EyasError(f"unexpected quantized weight for '{name}' in checkpoint") from None
        if len(scale_dtypes) > 1:
            raise EyasError(f"the parts of {name} ship scales of different dtypes {sorted(map(str, scale_dtypes))}")
        with torch.device("meta"):
            if isinstance(old, Experts):
                new = QuantExperts.replacing(old, fmt, scale_dtypes.pop())
            else:
                new = QuantLinear.replacing(old, fmt, scale_dtypes.pop())
                if new.bias is not None:
                    new.bias = nn.Parameter(torch.empty(new.bias.shape, dtype=dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)


def packed_bytes(files: list[Path], dtype: torch.dtype, skip=lambda key: False) -> int:
    """The checkpoint's bytes as the model holds them: quantized pieces (and any integer tensor) as shipped,
    dense floating tensors in the load dtype."""
    total = 0
    for f in files:
        for key, info in read_header(f).items():
            if skip(key):
                continue
            stored = SAFETENSORS_DTYPES.get(info["dtype"])
            if stored is None:
                raise EyasError(f"{f.name}: tensor {key} has unknown dtype {info['dtype']}")
            numel = 1
            for n in info["shape"]:
                numel *= n
            piece = key.rpartition(".")[2]
            as_shipped = piece in PIECE_SUFFIX and piece != "weight" or not castable(stored)
            total += numel * (stored.itemsize if as_shipped else dtype.itemsize)
    return total


def castable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize > 1


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    rows, cols = q.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise EyasError(f"fp8 scale has shape {tuple(scale_inv.shape)}, expected {want} for a {rows}x{cols} weight "
                        f"in {br}x{bc} blocks")
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group: int,
                    zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight; group 0 is one group per row (the "channel" scheme)."""
    rows, cols = (int(n) for n in shape.tolist())
    group = group or cols
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols // 8)):
        raise EyasError(f"int4 weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 "
                        f"{(rows, -(-cols // 8))} for weight_shape {(rows, cols)}")
    if tuple(scale.shape) != (rows, -(-cols // group)):
        raise EyasError(f"int4 weight_scale has shape {tuple(scale.shape)}, expected {(rows, -(-cols // group))} "
                        f"for group size {group}")
    q = unpack_rows(packed, cols) - 8
    if zero_point is not None:
        q = q - (unpack_cols(zero_point, rows) - 8).repeat_interleave(group, 1)[:, :cols]
    return q.float() * scale.float().repeat_interleave(group, 1)[:, :cols]


# -- writers (tests, tiny checkpoints) ---------------------------------------------------------------
def quantize_fp8_blocks(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn weight, fp32 weight_scale_inv) with each block's max mapped to 448."""
    rows, cols = w.shape
    br, bc = block
    pad = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc, dtype=torch.float32)
    pad[:rows, :cols] = w.float()
    blocks = pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(FP8).max).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view_as(pad)[:rows, :cols].to(FP8)
    return q, scale


def pack_int4_groups(w: torch.Tensor, group: int, symmetric: bool = True) -> dict[str, torch.Tensor]:
    """w [out, in] -> compressed-tensors pack-quantized pieces; group 0 is one group per row. Symmetric: scale =
    group absmax / 7; asymmetric: scale = group range / 15 and a zero point that maps the group's min to -8."""
    rows, cols = w.shape
    group = group or cols
    if cols % group:
        raise EyasError(f"input size {cols} is not a multiple of group size {group}")
    groups = w.float().view(rows, cols // group, group)
    if symmetric:
        scale = (groups.abs().amax(-1) / 7).clamp(min=1e-12)
        zero = torch.zeros_like(scale)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        zero = (-8 - lo / scale).round().clamp(-8, 7)
    q = (groups / scale[..., None] + zero[..., None]).round().clamp(-8, 7).view(rows, cols).to(torch.int32)
    parts = {"weight_packed": pack_nibbles(q + 8), "weight_scale": scale,
             "weight_shape": torch.tensor([rows, cols], dtype=torch.int32)}
    if not symmetric:
        parts["weight_zero_point"] = pack_nibbles(zero.to(torch.int32).T + 8).T.contiguous()
    return parts


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in 0..15 -> int32 [R, ceil(C/8)], value 8p + j in bits 4j..4j+3 of word p."""
    q = torch.nn.functional.pad(values.long(), (0, -values.shape[1] % 8)).view(values.shape[0], -1, 8)
    words = torch.zeros(q.shape[:2], dtype=torch.int64)
    for j in range(8):
        words |= q[..., j] << (4 * j)
    return (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32)  # the bit pattern as a signed int32
