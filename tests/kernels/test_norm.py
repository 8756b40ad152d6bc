"""The fused RMSNorm kernels against eyas.layers.norm.RMSNorm.

What is asserted, and why not always bit-equality: the kernel sums the squares in a different order than
torch's reduction, so the fp32 inverse RMS can differ in its last bits. fp32 outputs are therefore checked
to 2e-6 relative (some 20 ulps; the measured worst case is about 3e-7: an ulp or two per rounding step and
a few for the reordered sum). When x is bf16 the normalised row is rounded to bf16 before the weight
multiply, and that last-bit difference can flip a rare rounding: there, at most 0.1% of the elements may
differ, each by at most 2^-6 relative (two bf16 ulps: one ulp of the normalised value, times the weight;
on the CPU interpreter none differ). Skipping a rounding the reference does changes far more elements
than that; a wrong eps changes the small-magnitude rows (scaled so mean(x^2) is near eps) by far more
than either bound.
"""

import pytest
import torch

from eyas.kernels.norm import add_rms_norm, rms_norm, rms_norm_pair
from eyas.layers.norm import RMSNorm

EPS = 1e-6


@pytest.fixture(autouse=True)
def _torch_references(monkeypatch):
    """The layers dispatch to these kernels on CUDA; the references must run their torch code."""
    monkeypatch.setenv("EYAS_KERNELS", "0")


def rows(shape, dtype, device, seed=0):
    """Random rows whose scales span 1e-3 (where eps matters) to 10."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    scales = torch.logspace(-3, 1, x.numel() // shape[-1]).view(*shape[:-1], 1)
    return (x * scales).to(device, dtype)


def reference_norm(n, dtype, device, seed=1):
    norm = RMSNorm(n, EPS).to(device)
    g = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.3 * torch.randn(n, generator=g)).to(device, dtype)
    return norm


def assert_normed_close(y, ref, x_dtype):
    assert y.dtype == ref.dtype and y.shape == ref.shape and y.is_contiguous()
    if x_dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=0)
    else:
        assert (y != ref).float().mean().item() <= 1e-3
        torch.testing.assert_close(y, ref, rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 576), (1, 1, 100)])
def test_rms_norm_pair_is_the_two_norms_side_by_side(device, dtype, shape):
    """One launch for both halves: bit for bit the two rms_norm launches it replaces, concatenated."""
    a, b = rows(shape, dtype, device, 2), rows(shape, dtype, device, 3)
    wa, wb = reference_norm(shape[-1], dtype, device, 4).weight, reference_norm(shape[-1], dtype, device, 5).weight
    y = rms_norm_pair(a, wa, b, wb, EPS)
    assert y.shape == (*shape[:-1], 2 * shape[-1])
    assert torch.equal(y, torch.cat([rms_norm(a, wa, EPS), rms_norm(b, wb, EPS)], dim=-1))
    with pytest.raises(ValueError, match="must match"):
        rms_norm_pair(a, wa, b[..., 1:], wb[1:], EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 576), (2, 4096), (1, 7168)])
def test_rms_norm_matches_reference(device, dtype, shape):
    x = rows(shape, dtype, device)
    norm = reference_norm(shape[-1], dtype, device)
    assert_normed_close(rms_norm(x, norm.weight, EPS), norm(x), dtype)


def test_rms_norm_bf16_input_fp32_weight_promotes_like_torch(device):
    x = rows((2, 3, 576), torch.bfloat16, device)
    norm = reference_norm(576, torch.float32, device)
    y, ref = rms_norm(x, norm.weight, EPS), norm(x)
    assert ref.dtype == torch.float32
    assert_normed_close(y, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_qwen3_head_norm_on_fused_qkv_views(device, dtype):
    """q/k norm over the head dim of [B, T, heads, D] views split out of one qkv projection output."""
    B, T, H, Hk, D = 2, 3, 4, 2, 128
    qkv = rows((B, T, (H + 2 * Hk) * D), dtype, device)
    q, k, _ = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(B, T, H, D), k.view(B, T, Hk, D)
    assert not q.is_contiguous()
    for t in (q, k):
        norm = reference_norm(D, dtype, device)
        assert_normed_close(rms_norm(t, norm.weight, EPS), norm(t), dtype)


def test_rms_norm_reads_strided_rows(device):
    """Rows that are a slice of a wider tensor (a row stride other than N) are read in place."""
    x = rows((2, 3, 640), torch.bfloat16, device)[..., :576]
    norm = reference_norm(576, torch.bfloat16, device)
    assert_normed_close(rms_norm(x, norm.weight, EPS), norm(x), torch.bfloat16)


@pytest.mark.parametrize("layout", ["three_row_groups", "strided_last_dim"])
def test_rms_norm_layouts_that_need_a_copy(device, layout):
    """Rows that two strides cannot address, and a strided last dim: the kernel works on a contiguous copy."""
    base = rows((2, 3, 2, 64), torch.float32, device)
    x = base.permute(1, 0, 2, 3) if layout == "three_row_groups" else base.transpose(-1, -2)
    norm = reference_norm(x.shape[-1], torch.float32, device)
    assert_normed_close(rms_norm(x, norm.weight, EPS), norm(x), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 576), (1, 2, 4096)])
def test_add_rms_norm_matches_residual_add_then_norm(device, dtype, shape):
    """h is bit-equal to torch's x + delta; y is the norm of that rounded sum (not of an fp32 sum)."""
    x, delta = rows(shape, dtype, device, seed=2), rows(shape, dtype, device, seed=3)
    norm = reference_norm(shape[-1], dtype, device)
    h, y = add_rms_norm(x, delta, norm.weight, EPS)
    ref_h = x + delta
    assert h.dtype == dtype and torch.equal(h, ref_h)
    assert_normed_close(y, norm(ref_h), dtype)


def test_add_rms_norm_reads_strided_rows(device):
    """A delta whose rows are a slice of a wider tensor is read in place, with its own row strides."""
    x = rows((2, 3, 576), torch.bfloat16, device, seed=2)
    delta = rows((2, 3, 640), torch.bfloat16, device, seed=3)[..., :576]
    norm = reference_norm(576, torch.bfloat16, device)
    h, y = add_rms_norm(x, delta, norm.weight, EPS)
    assert torch.equal(h, x + delta)
    assert_normed_close(y, norm(x + delta), torch.bfloat16)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])  # bf16 x with fp32 weights: autocast training
@pytest.mark.parametrize("shape", [(3, 5, 40), (70, 96)])             # partial rows of a block; several programs
def test_training_norm_matches_torch_forward_and_backward(monkeypatch, device, x_dtype, shape):
    from eyas.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], 1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g).to(device))
    x = (torch.randn(shape, generator=g) * 3).to(device, x_dtype)
    dy = torch.randn(shape, generator=g).to(device)

    def run(mode):
        monkeypatch.setenv("EYAS_KERNELS", mode)
        norm.weight.grad = None
        xa = x.clone().requires_grad_(True)
        y = norm(xa)
        y.backward(dy)
        return y, xa.grad, norm.weight.grad

    want = run("0")
    got = run("force")
    assert got[0].dtype == want[0].dtype == torch.float32 and got[1].dtype == x_dtype
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    tol = dict(atol=1e-5, rtol=1e-4) if x_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], **tol)
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-4)
