"""Quantized linears and experts kept packed: their torch reference equals dequantize-then-matmul exactly (int4
in groups or per row, with or without zero points, FP8 blocks; fp32 and bf16), checkpoint pieces shard and fuse
as the dense weights do, the kernel paths (Triton's interpreter here) agree with the reference, and the fused
decode projections pass a quantized linear by."""

import pytest
import torch
import torch.nn.functional as F

from eyas.tensor_parallel import TPContext
from eyas.errors import EyasError
from eyas.layers import quant_linear
from eyas.layers.fused_linear import norm_linear
from eyas.layers.linear import ColumnParallelLinear, RowParallelLinear
from eyas.layers.norm import RMSNorm
from eyas.layers.quant_linear import QuantFormat, QuantLinear
from eyas.models.moe import Experts
from eyas.models.quant import dequantize_fp8, dequantize_int4, pack_int4_groups, quantize_fp8_blocks
from eyas.models.quant_experts import QuantExperts

def scale_dtype(fmt: QuantFormat) -> torch.dtype:
    return torch.float32 if fmt.method == "fp8" else torch.bfloat16  # as DeepSeek and Kimi ship them


FORMATS = {"int4-g32": QuantFormat("int4", 32), "int4-g128": QuantFormat("int4", 128),
           "int4-channel": QuantFormat("int4", 0), "int4-g32-zero-points": QuantFormat("int4", 32, symmetric=False),
           "fp8-16x16": QuantFormat("fp8", block=(16, 16))}


def shipped(fmt: QuantFormat, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(checkpoint pieces under our param names, the fp32 weight they define) for w in `fmt`."""
    if fmt.method == "fp8":
        q, s = quantize_fp8_blocks(w, list(fmt.block))
        return {"weight": q, "weight_scale": s}, dequantize_fp8(q, s, list(fmt.block))
    parts = pack_int4_groups(w, fmt.group, fmt.symmetric)
    parts["weight_scale"] = parts["weight_scale"].to(torch.bfloat16)
    dense = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], fmt.group,
                            parts.get("weight_zero_point"))
    pieces = {"weight": parts.pop("weight_packed"), **parts}
    return pieces, dense


def load_all(module, pieces: dict, shard=None):
    for name, t in pieces.items():
        module.load(name, t, shard)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_dequantize_then_matmul(name, dtype):
    """A fused gate/up column-parallel linear: two shipped blocks, one quantized weight."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(48, 256, generator=g), torch.randn(48, 256, generator=g)
    layer = QuantLinear.replacing(ColumnParallelLinear(256, [48, 48], False), fmt, scale_dtype(fmt))
    dense = []
    for part, w in enumerate((gate, up)):
        pieces, deq = shipped(fmt, w)
        load_all(layer, pieces, part)
        dense.append(deq)
    x = torch.randn(3, 5, 256, generator=g).to(dtype)
    want = F.linear(x, torch.cat(dense).to(dtype))
    assert torch.equal(layer(x), want)
    assert layer.weight.dtype == fmt.values_dtype() and layer.weight.numel() * layer.weight.element_size() < (
        96 * 256 * (1 if fmt.method == "fp8" else 0.5) + 1)


def test_large_weights_are_dequantized_a_block_of_rows_at_a_time(monkeypatch):
    fmt = FORMATS["int4-g32-zero-points"]
    pieces, dense = shipped(fmt, torch.randn(80, 64))
    layer = QuantLinear.replacing(torch.nn.Linear(64, 80, bias=False), fmt, torch.bfloat16)
    load_all(layer, pieces)
    x = torch.randn(4, 64)
    monkeypatch.setattr(quant_linear, "DENSE_CHUNK", 16 * 64)  # 16 rows a block: five blocks
    torch.testing.assert_close(layer(x), F.linear(x, dense), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["int4-g32", "int4-channel", "int4-g32-zero-points", "fp8-16x16"])
def test_tensor_parallel_ranks_take_their_slices(name):
    """Rank 1 of 2: a column-parallel linear keeps its half of the rows of every fused block, a row-parallel one
    its half of the columns, each piece cut on its quantization blocks."""
    fmt = FORMATS[name]
    tp = TPContext(rank=1, size=2)
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    col = QuantLinear.replacing(ColumnParallelLinear(64, [32, 32], False, tp), fmt, torch.float32)
    want = []
    for part, w in enumerate((gate, up)):
        pieces, deq = shipped(fmt, w)
        load_all(col, {k: v.float() if k == "weight_scale" else v for k, v in pieces.items()}, part)
        want.append(deq[16:])
    assert torch.equal(col.dense_weight(torch.float32), torch.cat(want))
    row = QuantLinear.replacing(RowParallelLinear(64, 32, False, tp), fmt, torch.float32)
    pieces, deq = shipped(fmt, gate)
    load_all(row, {k: v.float() if k == "weight_scale" else v for k, v in pieces.items()})
    assert torch.equal(row.dense_weight(torch.float32), deq[:, 32:])


def test_slices_off_the_quantization_blocks_are_refused():
    tp = TPContext(rank=1, size=2)
    pieces, _ = shipped(FORMATS["int4-g32"], torch.randn(8, 32))  # one group of 32 columns, split in two
    row = QuantLinear.replacing(RowParallelLinear(32, 8, False, tp), FORMATS["int4-g32"], torch.bfloat16)
    with pytest.raises(EyasError, match="does not align with its 32-wide quantization blocks"):
        load_all(row, pieces)


def test_bad_pieces_fail_by_name():
    fmt = FORMATS["int4-g32"]
    layer = QuantLinear.replacing(torch.nn.Linear(64, 16, bias=False), fmt, torch.bfloat16)
    with pytest.raises(EyasError, match="weight_shape is \\(16, 32\\), expected \\(16, 64\\)"):
        layer.load("weight_shape", torch.tensor([16, 32]))
    with pytest.raises(EyasError, match=r"weight\[0\] is torch.float32, expected torch.int32"):
        layer.load("weight", torch.zeros(16, 8))  # a dense tensor where packed values belong
    with pytest.raises(EyasError, match=r"weight_scale\[0\] has shape \(16, 1\), expected \(16, 2\)"):
        layer.load("weight_scale", torch.zeros(16, 1, dtype=torch.bfloat16))


def test_fused_decode_projections_pass_a_quantized_linear_by(monkeypatch):
    """With kernels forced on (the interpreter), norm_linear would fuse a dense projection; a quantized one keeps
    its own forward (here the W4A16 kernel, at 2 rows), which equals norm then the dequantized matmul."""
    monkeypatch.setenv("EYAS_KERNELS", "force")
    fmt = FORMATS["int4-g32"]
    pieces, dense = shipped(fmt, torch.randn(32, 64))
    layer = QuantLinear.replacing(ColumnParallelLinear(64, [32], False), fmt, torch.bfloat16)
    load_all(layer, pieces, 0)
    norm = RMSNorm(64, 1e-6)
    h = torch.randn(1, 2, 64)
    with torch.no_grad():
        _, got = norm_linear(norm, layer, h, None)
        torch.testing.assert_close(got, F.linear(norm(h), dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int4-g32", "int4-g32-zero-points", "fp8-16x16"])
def test_experts_reference_equals_the_dense_experts_and_the_fast_paths_agree(name):
    fmt = FORMATS[name]
    E, H, inter, N, k = 4, 64, 32, 5, 2
    g = torch.Generator().manual_seed(2)
    dense = Experts(E, H, inter, TPContext())
    quant = QuantExperts.replacing(dense, fmt, scale_dtype(fmt))
    with torch.no_grad():
        for e in range(E):
            for part in (0, 1):
                pieces, deq = shipped(fmt, torch.randn(inter, H, generator=g))
                for piece, t in pieces.items():
                    quant.load(piece.replace("weight", "gate_up_proj"), t, (e, part))
                dense.load("gate_up_proj", deq, (e, part))
            pieces, deq = shipped(fmt, torch.randn(H, inter, generator=g))
            for piece, t in pieces.items():
                quant.load(piece.replace("weight", "down_proj"), t, e)
            dense.load("down_proj", deq, e)
    x = torch.randn(N, H, generator=g)
    weights, ids = torch.rand(N, k, generator=g), torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    with torch.no_grad():
        want = dense.forward_reference(x, weights, ids)
        assert torch.equal(quant(x, weights, ids), want)  # on the CPU: the reference, bit for bit
        torch.testing.assert_close(quant.forward_sorted(x, weights, ids), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(quant.forward_kernel(x, weights, ids), want, rtol=1e-4, atol=1e-4)
