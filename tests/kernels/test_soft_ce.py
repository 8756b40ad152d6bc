"""The soft cross-entropy kernel (eyas.kernels.soft_ce) against its torch meaning, forward and backward,
and TTT's loss and gradients with and without it."""

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


def test_ttt_loss_and_gradients_are_the_same_with_the_kernel(monkeypatch, device):
    from eyas.config import DraftConfig
    from eyas.models.eagle3 import Eagle3Draft
    from eyas.train.ttt import Teacher, TTTModel

    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=300,
                      draft_vocab_size=120, target_hidden_size=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(device)
    B, T = 2, 12
    embeds, features = torch.randn(B, T, 32, device=device), torch.randn(B, T, 96, device=device)
    probs = torch.softmax(torch.randn(B, T, 120, device=device), -1)
    teacher = Teacher(probs, probs.argmax(-1), torch.rand(B, T, device=device) > 0.3)

    def run(mode):
        monkeypatch.setenv("EYAS_KERNELS", mode)
        draft.zero_grad()
        loss, stats = TTTModel(draft, steps=3)(embeds, features, teacher)
        loss.backward()
        return loss, stats, [p.grad.clone() for p in draft.parameters()]

    loss0, stats0, grads0 = run("0")
    loss1, stats1, grads1 = run("force")
    torch.testing.assert_close(loss1, loss0, atol=1e-5, rtol=1e-5)
    assert torch.equal(stats1["acc"], stats0["acc"])
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
