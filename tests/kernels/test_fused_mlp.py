"""The two-kernel MLP block (add + RMSNorm + gate/up + SiLU-and-mul + down) against its torch meaning.

What is asserted: the residual stream h is torch's `x + delta` bit for bit. The down projection's input is
what the unfused torch ops write (the reference computes it with them: the same roundings), and the kernels
accumulate the products in fp32, so y is compared with the product of that input in float64, rounded once,
to the bounds of test_fused_linear (fp32 1e-5 of the output's scale, which TF32 would miss; bf16 one ulp).
Shapes: K, the intermediate size and N are not multiples of the tiles, and I spans several programs.
"""

import pytest
import torch
import torch.nn.functional as F

from eyas.kernels import fused_mlp
from eyas.kernels.fused_mlp import norm_mlp
from eyas.layers import fused_linear as layer
from eyas.layers.linear import ColumnParallelLinear, RowParallelLinear
from eyas.layers.norm import RMSNorm
from tests.kernels.test_fused_linear import assert_product_close, rand

EPS = 1e-6
K, INTER, N = 96, 80, 40


@pytest.fixture(autouse=True)
def _torch_references(monkeypatch):
    monkeypatch.setenv("EYAS_KERNELS", "0")


@pytest.fixture(params=[(16, 64, 32), (32, 32, 64)], ids=["i16-k64-n32", "i32-k32-n64"])
def tile(request, monkeypatch, device):
    """The tile, as the interpreter's setting on the CPU, as the only candidate on a GPU: I in 5 or 3
    programs, K in 2 or 3 chunks, N in 2 or 1 column blocks."""
    import triton

    i, k, n = request.param
    monkeypatch.setattr(fused_mlp, "_INTERPRETER_TILE", {"BLOCK_I": i, "BLOCK_K": k, "BLOCK_N": n})
    if device == "cuda":
        from eyas.kernels import tile_choice

        config = triton.Config({"BLOCK_I": i, "BLOCK_K": k, "BLOCK_N": n}, num_warps=4)
        monkeypatch.setattr(fused_mlp, "_candidates", lambda: [config])
        monkeypatch.setattr(tile_choice, "_picked", {})
    return request.param


def _weights(dtype, device):
    norm = RMSNorm(K, EPS).to(device, dtype)
    norm.weight.data = 1 + 0.3 * rand(K, dtype, device, 2)
    gate_up = rand((2 * INTER, K), dtype, device, 3, K ** -0.5)
    down = rand((N, INTER), dtype, device, 4, INTER ** -0.5)
    return norm, gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(1, 1), (1, 4), (1, 5), (2, 4)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_norm_mlp_matches_the_unfused_block(device, dtype, rows, with_delta, tile):
    x = rand((*rows, K), dtype, device, 0)
    delta = rand((*rows, K), dtype, device, 1) if with_delta else None
    norm, gate_up, down = _weights(dtype, device)
    h, y = norm_mlp(x, delta, norm.weight, EPS, gate_up, down)
    h_ref, x_in = norm.residual(x, delta) if with_delta else (x, norm(x))
    assert torch.equal(h, h_ref)
    gate, up = F.linear(x_in, gate_up).chunk(2, dim=-1)
    assert_product_close(y, F.silu(gate) * up, down)


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.zeros(1, K)
    ok = dict(norm_weight=torch.ones(K), eps=EPS, gate_up_weight=torch.zeros(2 * INTER, K),
              down_weight=torch.zeros(N, INTER))
    with pytest.raises(TypeError, match="share one"):
        norm_mlp(x, None, **{**ok, "down_weight": torch.zeros(N, INTER, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="is not"):
        norm_mlp(x, None, **{**ok, "gate_up_weight": torch.zeros(2 * INTER + 1, K)})
    with pytest.raises(ValueError, match="does not take 80"):
        norm_mlp(x, None, **{**ok, "down_weight": torch.zeros(N, INTER + 1)})
    with pytest.raises(ValueError, match="delta"):
        norm_mlp(x, torch.zeros(2, K), **ok)
    with pytest.raises(ValueError, match="exceed"):
        norm_mlp(torch.zeros(17, K), None, **ok)


@pytest.mark.parametrize("tokens,mlp_rows,fused_expected", [(4, "4", True), (4, None, False), (5, "4", False),
                                                             (2, "4", False), (4, "0", False)])
def test_layer_runs_the_block_for_rows_past_the_fused_projections(device, monkeypatch, tokens, mlp_rows,
                                                                  fused_expected):
    """layers.fused_linear.norm_mlp takes these kernels for more rows than the fused projections take
    (max_rows(), 2) and at most EYAS_FUSED_MLP_ROWS (unset: never); the result is the unfused block's either
    way (the row-parallel bias added after the kernels)."""
    for name in ("EYAS_FUSED_MAX_ROWS", "EYAS_FUSED_LINEAR", "EYAS_FUSED_MLP_ROWS"):
        monkeypatch.delenv(name, raising=False)
    if mlp_rows is not None:
        monkeypatch.setenv("EYAS_FUSED_MLP_ROWS", mlp_rows)
    norm = RMSNorm(K, EPS).to(device)
    norm.weight.data = 1 + 0.3 * rand(K, torch.float32, device, 2)
    col = ColumnParallelLinear(K, [INTER] * 2, False).to(device)
    row = RowParallelLinear(INTER, N, True).to(device)
    for p in (*col.parameters(), *row.parameters()):
        p.data = rand(p.shape, torch.float32, device, p.numel(), 0.1)
    x, delta = (rand((1, tokens, K), torch.float32, device, s) for s in (5, 6))
    h_ref, x_in = norm.residual(x, delta)
    y_ref = row(F.silu(col(x_in).chunk(2, -1)[0]) * col(x_in).chunk(2, -1)[1])

    calls = []
    monkeypatch.setattr(fused_mlp, "norm_mlp", lambda *a, _f=fused_mlp.norm_mlp: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with torch.no_grad():
        h, y = layer.norm_mlp(norm, col, row, x, delta)
    assert bool(calls) == fused_expected
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
