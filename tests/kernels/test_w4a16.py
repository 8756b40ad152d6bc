"""The W4A16 / FP8-block kernel equals the layer's torch reference (dequantize to x's dtype, then matmul) on tiny
shapes: symmetric and zero-point int4 in groups and per row, FP8 blocks with ragged edges, dense rows across
the 16-row tile, and routed-expert rows that each name their expert."""

from pathlib import Path

import pytest
import torch

from eyas.kernels.w4a16 import quant_linear_rows
from eyas.layers.quant_linear import QuantFormat, reference_matmul
from eyas.models.quant import pack_int4_groups, quantize_fp8_blocks
from tests.helpers import run_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_w4a16.py"

SCHEMES = {"int4-g32": QuantFormat("int4", 32), "int4-g16-zero-points": QuantFormat("int4", 16, symmetric=False),
           "int4-channel": QuantFormat("int4", 0), "fp8-16x16": QuantFormat("fp8", block=(16, 16))}


def packed(fmt: QuantFormat, w: torch.Tensor):
    """(values, scale, zero point) of w in `fmt`."""
    if fmt.method == "fp8":
        q, s = quantize_fp8_blocks(w, list(fmt.block))
        return q, s, None
    parts = pack_int4_groups(w, fmt.group, fmt.symmetric)
    return parts["weight_packed"], parts["weight_scale"].to(torch.bfloat16), parts.get("weight_zero_point")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_dense_rows_equal_the_reference(device, scheme, rows):
    fmt = SCHEMES[scheme]
    g = torch.Generator().manual_seed(rows)
    n, k = 40, 96  # 40 outputs: a partial tile of 64 and, for fp8, a partial 16-row block
    values, scale, zero = packed(fmt, torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    want = reference_matmul(x, fmt, values, scale, zero, k)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = quant_linear_rows(x.to(device), fmt, to(values), to(scale), to(zero), block_k=32).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g16-zero-points", "fp8-16x16"])
def test_expert_rows_use_their_own_expert(device, scheme):
    fmt = SCHEMES[scheme]
    g = torch.Generator().manual_seed(0)
    experts = [packed(fmt, torch.randn(24, 64, generator=g)) for _ in range(3)]
    stack = [torch.stack([e[i] for e in experts]) if experts[0][i] is not None else None for i in range(3)]
    x = torch.randn(6, 64, generator=g)
    ids = torch.tensor([2, 0, 2, 1, 1, 0])
    want = torch.stack([reference_matmul(x[r], fmt, *experts[e], 64) for r, e in enumerate(ids.tolist())])
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = quant_linear_rows(x.to(device), fmt, *map(to, stack), expert_ids=ids.to(device), block_k=32).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
def test_bf16_activations_round_the_weight_as_the_reference_does(device, experts):
    """In bf16 the kernel rounds each dequantized value to bf16, as the reference's dense weight holds it; what
    remains is the order of the fp32 sums before the output's one rounding: at most one bf16 step apart."""
    fmt = SCHEMES["int4-g32"]
    g = torch.Generator().manual_seed(3)
    values, scale, zero = packed(fmt, torch.randn(32, 64, generator=g))
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    want = reference_matmul(x, fmt, values, scale, zero, 64)
    extra = dict(expert_ids=torch.zeros(3, dtype=torch.int32, device=device)) if experts else {}
    values, scale = (values[None], scale[None]) if experts else (values, scale)
    got = quant_linear_rows(x.to(device), fmt, values.to(device), scale.to(device), block_k=32, **extra).cpu()
    assert got.dtype == torch.bfloat16
    step = want.float().abs().clamp(min=2 ** -10) * 2 ** -7  # one bf16 step at each value's magnitude
    assert ((got.float() - want.float()).abs() <= step).all()


def test_bad_shapes_are_refused():
    fmt = SCHEMES["int4-g32"]
    values, scale, _ = packed(fmt, torch.randn(8, 64))
    with pytest.raises(ValueError, match="do not hold 32 input features"):
        quant_linear_rows(torch.randn(1, 32), fmt, values, scale)
    with pytest.raises(ValueError, match="with expert ids"):
        quant_linear_rows(torch.randn(1, 64), fmt, values, scale, expert_ids=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("rows", ["0", "1,17", "x"])
def test_the_benchmark_refuses_bad_rows_in_one_line(rows):
    run = run_script(BENCH, "--rows", rows)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --rows")
