"""The fused norm+linear and SiLU-and-mul+linear kernels against their torch meaning.

What is asserted: the residual stream h is torch's `x + delta` bit for bit. The projection's input is
what the unfused ops write (the reference computes it with the torch paths), and the kernel accumulates
its products in fp32, so y is compared with the product of that input computed in float64 and rounded
once: fp32 to 1e-5 of the output's scale (an accumulation-order difference is ~1e-7 of it; TF32, which
the kernel must not use for fp32, errs by ~1e-3), bf16 to one ulp of each element plus 1% of an ulp of
the largest (a last-bit difference of the norm's sum may flip a rare rounding of one input element).
Shapes are chosen so that K and N are not powers of two (the tiles' sizes).
"""

import pytest
import torch
import torch.nn.functional as F

from eyas import execution_plan
from eyas.kernels.fused_linear import linear_rows, norm_linear, silu_mul_linear
from eyas.layers import fused_linear as layer
from eyas.layers.linear import ColumnParallelLinear, RowParallelLinear
from eyas.layers.norm import RMSNorm

EPS = 1e-6
K, N, INTER = 96, 40, 80


def rand(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(device, dtype)


def assert_product_close(y, x_in, w, bias=None):
    """y against x_in @ w^T (+ bias) in float64, rounded once to y's dtype."""
    ref64 = x_in.double() @ w.double().T + (bias.double() if bias is not None else 0)
    ref = ref64.to(y.dtype)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = ref64.abs().max().item()
    if y.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref64, rtol=0, atol=1e-5 * scale)
    else:
        ulp = (ref.float().abs() * 2 ** -7).clamp_min(2 ** -133)
        assert ((y.float() - ref64.float()).abs() <= ulp + 0.01 * scale * 2 ** -7).all()


@pytest.fixture(autouse=True)
def _torch_references(monkeypatch):
    monkeypatch.setenv("EYAS_KERNELS", "0")


@pytest.fixture(params=[0, 32, 64], ids=["whole-rows", "k-chunks-32", "k-chunks-64"])
def chunk_k(request, monkeypatch, device):
    """The tile: whole rows, or K in chunks (96 = 3 x 32, or 64 + a partial 32). In the interpreter through
    its module setting; on a GPU as the only candidate tile, so that each case compiles and runs
    that tile, deterministically, instead of timing every tile for every case (the kernel tests took 317 s on
    an H200 that way)."""
    import triton

    import eyas.kernels.fused_linear as kernels

    monkeypatch.setattr(kernels, "_INTERPRETER_CHUNK_K", request.param)
    if device == "cuda":
        from eyas.kernels import tile_choice

        tile = triton.Config({"BLOCK_N": 16 if request.param else 8, "CHUNK_K": request.param}, num_warps=4)
        monkeypatch.setattr(kernels, "_candidates", lambda m, k: [tile])
        monkeypatch.setattr(tile_choice, "_picked", {})
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(1, 1), (2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("with_delta,with_bias", [(True, False), (False, True)])
def test_norm_linear_matches_add_norm_then_linear(device, dtype, rows, with_delta, with_bias, chunk_k):
    x = rand((*rows, K), dtype, device, 0)
    delta = rand((*rows, K), dtype, device, 1) if with_delta else None
    norm = RMSNorm(K, EPS).to(device)
    norm.weight.data = 1 + 0.3 * rand(K, dtype, device, 2)
    w = rand((N, K), dtype, device, 3, K ** -0.5)
    bias = rand(N, dtype, device, 4) if with_bias else None
    h, y = norm_linear(x, delta, norm.weight, EPS, w, bias)
    h_ref, x_in = norm.residual(x, delta) if with_delta else (x, norm(x))
    assert torch.equal(h, h_ref)
    assert_product_close(y, x_in, w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(1, 1), (1, 2), (1, 5), (2, 4)])
def test_silu_mul_linear_matches_silu_mul_then_linear(device, dtype, rows, chunk_k):
    gate_up = rand((*rows, 2 * INTER), dtype, device, 0, 4.0)
    w = rand((N, INTER), dtype, device, 1, INTER ** -0.5)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_product_close(silu_mul_linear(gate_up, w), F.silu(gate) * up, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(1, 1), (1, 2), (2, 4)])
def test_linear_rows_matches_linear(device, dtype, rows, chunk_k):
    x = rand((*rows, K), dtype, device, 0)
    w = rand((N, K), dtype, device, 1, K ** -0.5)
    assert_product_close(linear_rows(x, w), x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(1, 1), (2, 3)])
def test_silu_mul_linear_adds_a_residual_as_torch_does(device, dtype, rows, chunk_k):
    """residual + the projection, the projection rounded to the dtype first: bit for bit torch's add of the
    two (the projection itself is the kernel's, as without a residual)."""
    gate_up = rand((*rows, 2 * INTER), dtype, device, 0, 4.0)
    w = rand((N, INTER), dtype, device, 1, INTER ** -0.5)
    residual = rand((*rows, N), dtype, device, 2)
    assert torch.equal(silu_mul_linear(gate_up, w, residual), residual + silu_mul_linear(gate_up, w))
    with pytest.raises(ValueError, match="residual"):
        silu_mul_linear(gate_up, w, residual[..., 1:])


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.zeros(1, K)
    with pytest.raises(TypeError, match="must be one of"):
        norm_linear(x, None, torch.ones(K), EPS, torch.zeros(N, K, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not take inputs of 96"):
        norm_linear(x, None, torch.ones(K), EPS, torch.zeros(N, K + 1))
    with pytest.raises(ValueError, match="delta"):
        norm_linear(x, torch.zeros(2, K), torch.ones(K), EPS, torch.zeros(N, K))
    with pytest.raises(ValueError, match="must be even"):
        silu_mul_linear(torch.zeros(1, 2 * INTER + 1), torch.zeros(N, INTER))
    with pytest.raises(ValueError, match="exceed"):
        norm_linear(torch.zeros(9, K), None, torch.ones(K), EPS, torch.zeros(N, K))
    with pytest.raises(ValueError, match="exceed"):
        silu_mul_linear(torch.zeros(1, 2 * 40000), torch.zeros(N, 40000))


def _layers(device):
    norm = RMSNorm(K, EPS).to(device)
    col = ColumnParallelLinear(K, [N], False).to(device)
    row = RowParallelLinear(INTER, N, True).to(device)
    for p in (*col.parameters(), *row.parameters()):
        p.data = rand(p.shape, torch.float32, device, p.numel(), 0.1)
    return norm, col, row


@pytest.mark.parametrize("tokens,max_k,max_rows,fused_expected", [
    (2, 2048, None, 2), (3, 2048, None, 0), (2, 64, None, 0), (4, 2048, 4, 2), (5, 2048, 4, 0),
    (8, 2048, 8, 2), (2, INTER, None, 1)])
def test_layers_fuse_decode_shapes_only(device, monkeypatch, tokens, max_k, max_rows, fused_expected):
    """The layer functions run the kernels for at most MAX_ROWS tokens (2, or as patched here up to
    KERNEL_ROWS) whose projection reads at most MAX_K features: K for the norm's, the intermediate size (half
    of gate_up's width) for SiLU-and-mul's, which a check of gate_up's own width had kept unfused on SmolLM2
    (1,536 of 3,072). Either way they give the unfused result (the row-parallel bias is added after the
    kernel)."""
    import eyas.kernels.fused_linear as kernels

    monkeypatch.setattr(kernels, "MAX_K", max_k)
    monkeypatch.setattr(kernels, "NARROW_N", 0)  # no projection counts as narrow (NARROW_ROWS' own test)
    if max_rows is not None:
        monkeypatch.setattr(kernels, "MAX_ROWS", max_rows)

    norm, col, row = _layers(device)
    x, delta, gate_up = (rand((1, tokens, n), torch.float32, device, s) for s, n in ((5, K), (6, K), (7, 2 * INTER)))
    h_ref, y_ref = layer.norm_linear(norm, col, x, delta)
    out_ref = layer.silu_mul_linear(row, gate_up)

    calls = []
    for name in ("norm_linear", "silu_mul_linear"):
        monkeypatch.setattr(kernels, name, lambda *a, _f=getattr(kernels, name): calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with torch.no_grad():
        h, y = layer.norm_linear(norm, col, x, delta)
        out = layer.silu_mul_linear(row, gate_up)
    assert len(calls) == fused_expected
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    calls.clear()
    with torch.no_grad(), execution_plan.using(fused_linear=False):
        layer.norm_linear(norm, col, x, delta)
    assert not calls


@pytest.mark.parametrize("narrow_rows,n_out,rows,fused_expected",
                         [(None, N, 4, 1), (None, N, 8, 1), (4, N, 4, 1), (4, N, 8, 0), (4, 4096, 4, 0),
                          (2, N, 4, 0), (None, 4096, 4, 0)])
def test_narrow_projections_fuse_up_to_narrow_rows(device, monkeypatch, narrow_rows, n_out, rows, fused_expected):
    """Past MAX_ROWS a projection of at most NARROW_N outputs runs the kernel up to NARROW_ROWS (8 by default, a
    tree's verify; patched here); a wider one, or more rows than that, keeps the unfused pair. The result is the unfused one either way."""
    import eyas.kernels.fused_linear as kernels

    monkeypatch.setattr(kernels, "NARROW_N", 2 * N)
    if narrow_rows is not None:
        monkeypatch.setattr(kernels, "NARROW_ROWS", narrow_rows)
    norm = RMSNorm(K, EPS).to(device)
    norm.weight.data = rand((K,), torch.float32, device, 11, 0.1) + 1
    col = ColumnParallelLinear(K, [n_out], False).to(device)
    col.weight.data = rand(col.weight.shape, torch.float32, device, 12, 0.1)
    x, delta = (rand((1, rows, K), torch.float32, device, s) for s in (13, 14))
    _, y_ref = layer.norm_linear(norm, col, x, delta)
    calls = []
    monkeypatch.setattr(kernels, "norm_linear", lambda *a, _f=kernels.norm_linear: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with torch.no_grad():
        _, y = layer.norm_linear(norm, col, x, delta)
    assert len(calls) == fused_expected
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)


def test_layers_keep_torch_paths_for_training(monkeypatch, device):
    """The kernels have no backward: with parameters that need gradients the layers run torch's ops."""
    norm, col, row = _layers(device)
    monkeypatch.setenv("EYAS_KERNELS", "force")
    x = torch.randn(1, 2, K, device=device)
    _, y = layer.norm_linear(norm, col, x, None)
    y.sum().backward()
    assert col.weight.grad is not None and norm.weight.grad is not None


def test_tile_pruning_keeps_every_tile_of_decode_rows():
    """The warm-up times every tile for 1-2 rows (as before the K-chunked tiles existed); at 8 rows of 1,536
    features the wide whole-row tiles, whose products would spill, are not even compiled."""
    from eyas.kernels.fused_linear import CONFIGS, _prune

    def tiles(**args):
        return {(c.kwargs["BLOCK_N"], c.kwargs["CHUNK_K"], c.num_warps) for c in _prune(CONFIGS, args)}

    every = {(c.kwargs["BLOCK_N"], c.kwargs["CHUNK_K"], c.num_warps) for c in CONFIGS}
    assert tiles(M=1, K=576) == tiles(M=2, I=1536) == every
    eight = tiles(M=8, I=1536)
    assert {(n, w) for n, c, w in every - eight} == {(8, 4), (8, 8), (16, 4), (16, 8)}
    assert all(c == 0 for _, c, _ in every - eight)


def test_a_lower_product_limit_drops_the_larger_whole_row_tiles():
    """The limit (a timing keyword, PRODUCT_LIMIT by default) bounds the products of the tiles timed: at
    16,384 a 4-row verify of 576 features keeps whole rows of at most 4 outputs and every chunked tile."""
    from eyas.kernels.fused_linear import CONFIGS, PRODUCT_LIMIT, _prune

    kept = {(c.kwargs["BLOCK_N"], c.kwargs["CHUNK_K"]) for c in _prune(CONFIGS, {"M": 4, "K": 576}, limit=16384)}
    assert {n for n, c in kept if c == 0} == {2, 4} and {(32, 128), (16, 64)} <= kept
    default = {(c.kwargs["BLOCK_N"], c.kwargs["CHUNK_K"]) for c in _prune(CONFIGS, {"M": 4, "K": 576})}
    assert PRODUCT_LIMIT == 65536 and kept < default


def test_kernels_refuse_inputs_wider_than_max_k(device):
    """Past MAX_K input features (an 8B model's 4,096 and 14,336) every kernel refuses the call with a one-line
    ValueError naming the limit: those projections stay with cuBLAS. MAX_K features themselves run."""
    import eyas.kernels.fused_linear as kernels

    k = kernels.MAX_K
    x, norm_w = torch.zeros(1, k + 1), torch.ones(k + 1)
    calls = {"norm_linear": lambda: norm_linear(x, None, norm_w, EPS, torch.zeros(N, k + 1)),
             "linear_rows": lambda: linear_rows(x, torch.zeros(N, k + 1)),
             "silu_mul_linear": lambda: silu_mul_linear(torch.zeros(1, 2 * (k + 1)), torch.zeros(N, k + 1))}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"^{name}: {k + 1} input features exceed the {k} it takes") as err:
            call()
        assert "\n" not in str(err.value)
    x, w = rand((1, k), torch.float32, device, 0), rand((N, k), torch.float32, device, 1, k ** -0.5)
    assert_product_close(linear_rows(x, w), x, w)


def test_layers_keep_cublas_for_wide_rows(device, monkeypatch):
    """Past MAX_K input features (a large model) none of the layer functions runs the kernels, the output
    projection included."""
    import eyas.kernels.fused_linear as kernels

    monkeypatch.setattr(kernels, "MAX_K", 64)  # K = 96 and INTER = 80 are then wide
    monkeypatch.setattr(kernels, "_INTERPRETER_CHUNK_K", 32)
    norm, col, row = _layers(device)
    x, gate_up = rand((1, 1, K), torch.float32, device, 5), rand((1, 1, 2 * INTER), torch.float32, device, 7)
    attn_out = rand((1, 1, INTER), torch.float32, device, 8)
    calls = []
    for name in ("norm_linear", "silu_mul_linear", "linear_rows"):
        monkeypatch.setattr(kernels, name, lambda *a, _f=getattr(kernels, name): calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with torch.no_grad():
        layer.norm_linear(norm, col, x, None), layer.silu_mul_linear(row, gate_up), layer.project_rows(row, attn_out)
        assert not calls
        monkeypatch.setattr(kernels, "MAX_K", 2048)  # not wide: the same calls run the kernels
        layer.norm_linear(norm, col, x, None), layer.silu_mul_linear(row, gate_up), layer.project_rows(row, attn_out)
        assert len(calls) == 3


def test_narrow_output_projection_fuses_unless_told_not_to(device, monkeypatch):
    """A small model's output projection (K <= MAX_K) runs the GEMV tiles at 1-2 rows, bias added after;
    with the plan's fused_o_proj=False, or at more rows than MAX_ROWS, cuBLAS (narrow projections' extra rows off)."""
    import eyas.kernels.fused_linear as kernels

    monkeypatch.setattr(kernels, "_INTERPRETER_CHUNK_K", 0)
    monkeypatch.setattr(kernels, "NARROW_ROWS", 0)
    _, _, row = _layers(device)
    calls = []
    monkeypatch.setattr(kernels, "linear_rows", lambda *a, _f=kernels.linear_rows: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    attn_out = rand((1, 2, INTER), torch.float32, device, 8)
    with torch.no_grad():
        ref = row(attn_out)
        with execution_plan.using(fused_o_proj=False):
            layer.project_rows(row, attn_out)
        assert not calls
        out = layer.project_rows(row, attn_out)
        assert len(calls) == 1
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        layer.project_rows(row, rand((1, 3, INTER), torch.float32, device, 9))  # 3 rows: past MAX_ROWS
        assert len(calls) == 1
