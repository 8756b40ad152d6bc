"""Quantized checkpoints as shipped, dequantized while streaming so the model itself stays bf16/fp32.

Two formats:
- FP8 block quantization (DeepSeek-V3): `X.weight` float8_e4m3fn [out, in] and `X.weight_scale_inv` fp32
  [ceil(out/br), ceil(in/bc)]; despite its name the scale multiplies: w = q * scale[i // br, j // bc].
- compressed-tensors pack-quantized int4 (Kimi-K2): `X.weight_packed` int32 [out, ceil(in/8)] holding eight
  4-bit values per int32, value j of a word in bits 4j..4j+3 (column 8p + j of the row), each stored
  unsigned with an offset of 8; `X.weight_scale` [out, in/group]; `X.weight_shape` [2]. Symmetric:
  w = (nibble - 8) * scale[i, j // group].

The pieces of one weight may arrive in any order (and from different shards), so each is held until its
partners arrive; a piece left without them is an error naming it. `quantize_fp8_blocks` and
`pack_int4_groups` write these layouts, for tests and for making small checkpoints.
"""

from __future__ import annotations

import torch

from eyas.errors import EyasError

FP8 = torch.float8_e4m3fn
# piece suffix -> the pieces that together make `weight`
PIECES = {"fp8": ("weight", "weight_scale_inv"), "int4": ("weight_packed", "weight_scale", "weight_shape")}


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    rows, cols = q.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise EyasError(f"fp8 scale has shape {tuple(scale_inv.shape)}, expected {want} for a {rows}x{cols} weight "
                        f"in {br}x{bc} blocks")
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = (int(n) for n in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols // 8)):
        raise EyasError(f"int4 weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 "
                        f"{(rows, -(-cols // 8))} for weight_shape {(rows, cols)}")
    if tuple(scale.shape) != (rows, -(-cols // group)):
        raise EyasError(f"int4 weight_scale has shape {tuple(scale.shape)}, expected {(rows, -(-cols // group))} "
                        f"for group size {group}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [rows, words, 8]; the mask drops the shift's sign bits
    q = nibbles.flatten(1)[:, :cols].float() - 8
    return q * scale.float().repeat_interleave(group, 1)[:, :cols]


def dequantize(tensors, quant: dict):
    """(key, tensor) stream with quantized pieces -> the same stream with one dense fp32 `X.weight` each."""
    method = quant["method"]
    names = PIECES[method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors:
        module, _, piece = key.rpartition(".")
        is_piece = piece in names and (piece != "weight" or tensor.dtype == FP8)
        if not is_piece:
            yield key, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[piece] = tensor
        if len(parts) < len(names):
            continue
        del pending[module]
        if method == "fp8":
            yield f"{module}.weight", dequantize_fp8(parts["weight"], parts["weight_scale_inv"], quant["block"])
        else:
            yield f"{module}.weight", dequantize_int4(parts["weight_packed"], parts["weight_scale"],
                                                      parts["weight_shape"], quant["group_size"])
    if pending:
        module, parts = next(iter(pending.items()))
        missing = [n for n in names if n not in parts]
        raise EyasError(f"checkpoint has {module}.{next(iter(parts))} but not {module}.{missing[0]}"
                        + (f" ({len(pending) - 1} more incomplete weights)" if len(pending) > 1 else ""))


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


def pack_int4_groups(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """w [out, in] -> compressed-tensors pack-quantized pieces (symmetric, scale = group absmax / 7)."""
    rows, cols = w.shape
    if cols % group:
        raise EyasError(f"input size {cols} is not a multiple of group size {group}")
    scale = (w.float().view(rows, cols // group, group).abs().amax(-1) / 7).clamp(min=1e-12)
    q = (w.float() / scale.repeat_interleave(group, 1)).round().clamp(-8, 7).to(torch.int32) + 8
    q = torch.nn.functional.pad(q, (0, -cols % 8)).view(rows, -1, 8)
    words = torch.zeros(q.shape[:2], dtype=torch.int64)
    for j in range(8):
        words |= q[..., j].long() << (4 * j)
    packed = (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32)  # the bit pattern as a signed int32
    shape = torch.tensor([rows, cols], dtype=torch.int32)
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
