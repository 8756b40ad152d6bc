"""The soft cross-entropy kernel (eyas.kernels.soft_ce) against its torch meaning, forward and backward.
TTT's loss and gradients with and without the kernels: tests/kernels/test_ttt_attention.py."""

import pytest
import torch

from eyas.train import soft_ce as dispatch

# Lanes past the vocabulary's end compute -inf - -inf (and 0 * -inf) in branches tl.where then discards;
# the interpreter's numpy says so with a RuntimeWarning, the compiled kernel silently.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def reference(z, p):
    z32 = z.float()
    return (p * torch.log_softmax(z32, dim=-1)).sum(-1), z32.argmax(-1)


def kernel(monkeypatch, z, p):
    monkeypatch.setenv("EYAS_KERNELS", "force")
    assert dispatch.switched_on(z)  # CPU tensors go through Triton's interpreter
    return dispatch.soft_cross_entropy(z, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [700, 2500])  # one partial chunk; several chunks and a partial one
def test_forward_and_backward_match_torch(monkeypatch, device, dtype, V):
    g = torch.Generator().manual_seed(V)
    B, T = 2, 5
    z = (torch.randn(B, T, V, generator=g) * 3).to(device, dtype)
    # The teacher is a slice of a longer [B, T + 2, V] tensor, as TTT's shifted steps read it.
    p_full = torch.softmax(torch.randn(B, T + 2, V, generator=g) * 2, dim=-1).to(device)
    p = p_full[:, 2:]
    w = torch.randn(B, T, generator=g).to(device)

    za = z.clone().requires_grad_(True)
    ce, top = kernel(monkeypatch, za, p)
    (ce * w).sum().backward()
    zb = z.clone().requires_grad_(True)
    want_ce, want_top = reference(zb, p)
    (want_ce * w).sum().backward()

    torch.testing.assert_close(ce, want_ce, atol=1e-4, rtol=1e-5)
    assert torch.equal(top, want_top)
    assert za.grad.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(za.grad, zb.grad, **tol)


def test_argmax_ties_pick_the_first(monkeypatch, device):
    V = 2100
    z = torch.zeros(1, 3, V)
    z[0, 0, [1500, 40, 2050]] = 5.0     # same maximum in three chunks: the lowest index wins
    z[0, 1, [1030, 6]] = 2.0            # same lane (6 + 1024), different chunks
    z[0, 2, :] = -1.0                   # all equal
    p = torch.full((1, 3, V), 1.0 / V)
    _, top = kernel(monkeypatch, z.to(device), p.to(device))
    assert top.tolist() == [[40, 6, 0]] == [z[0].argmax(-1).tolist()]


def test_bad_shapes_raise(monkeypatch):
    from eyas.kernels.soft_ce import soft_ce_forward

    with pytest.raises(ValueError, match="differ in shape"):
        soft_ce_forward(torch.zeros(1, 2, 8), torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        soft_ce_forward(torch.zeros(1, 8, 2).transpose(1, 2), torch.zeros(1, 2, 8))
