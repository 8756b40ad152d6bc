"""layers.linear.dense, the CPU linears' oneDNN path: F.linear's meaning for every input the layers give it, and
torch's own path wherever a gradient is wanted (oneDNN's call has no backward)."""

import pytest
import torch
import torch.nn.functional as F

from eyas.layers import linear
from eyas.layers.linear import dense


@pytest.mark.parametrize("shape", [(1, 32), (4, 32), (2, 3, 32), (0, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    torch.testing.assert_close(dense(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_dense_takes_strided_views():
    """A fused weight's rows (a view into a wider buffer) and a transposed input, as the draft passes them."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(96, 32, generator=g)
    x = torch.randn(32, 5, generator=g).t()
    torch.testing.assert_close(dense(x, fused[16:64]), F.linear(x, fused[16:64]), rtol=1e-5, atol=1e-5)


def test_dense_keeps_autograd():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    dense(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_matches_f_linear_in_each_dtype(dtype):
    """bf16 too, on CPUs whose oneDNN refuses it (no bf16 instructions): there F.linear runs it."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 32, generator=g).to(dtype), torch.randn(48, 32, generator=g).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(dense(x, w), F.linear(x, w))


def test_onednn_takes_only_the_dtypes_it_runs():
    for dtype in linear.ONEDNN_DTYPES:
        x, w = torch.ones(2, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: SLF001
    assert set(linear.ONEDNN_DTYPES) <= {torch.float32, torch.bfloat16}


@pytest.mark.skipif(torch.float32 not in linear.ONEDNN_DTYPES, reason="this torch has no oneDNN linear")
def test_dense_runs_onednn_on_cpu_inference(monkeypatch):
    """Inference on the CPU never reaches F.linear; a weight that wants a gradient always does."""
    calls = []
    real = F.linear
    monkeypatch.setattr(linear.F, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        dense(torch.randn(2, 4), torch.randn(3, 4))
    assert calls == []
    dense(torch.randn(2, 4), torch.randn(3, 4, requires_grad=True))
    assert calls == [1]
