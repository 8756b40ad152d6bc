"""The TTT attention kernel (eyas.kernels.ttt_attention) against the torch path, forward and backward, and a
whole TTT loss with and without the training kernels."""

import pytest
import torch

from eyas.train import ttt

# Rows past the sequence's end compute exp2(-inf - -inf) in branches tl.where then discards; the
# interpreter's numpy says so with a RuntimeWarning, the compiled kernel silently.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def inputs(device, dtype, B, T, H, G, D, steps, seed):
    g = torch.Generator().manual_seed(seed)
    # q is a strided view out of a wider projection, as the draft's fused q/k/v output is.
    wide = torch.randn(B, T, H + 1, D, generator=g)
    q = wide[:, :, 1:].to(device, dtype)
    kv = lambda: torch.randn(B, T, G, D, generator=g).to(device, dtype)  # noqa: E731
    cache = [(kv(), kv()) for _ in range(steps)]
    return q, cache


def run(monkeypatch, mode, q, cache, scale, grad):
    monkeypatch.setenv("EYAS_KERNELS", mode)
    q = q.detach().clone().requires_grad_(True)
    cache = [(k.detach().clone().requires_grad_(True), v.detach().clone().requires_grad_(True)) for k, v in cache]
    assert ttt._kernel_fits(q, cache) == (mode == "force")
    out = ttt.ttt_attention(q, cache, scale)
    out.backward(grad)
    return out, [q.grad] + [t.grad for kv in cache for t in kv]


@pytest.mark.parametrize("steps", [1, 2, 4])   # step 0 alone; one and three diagonals
@pytest.mark.parametrize("T", [37, 70])        # one partial tile; a full tile and a partial one
def test_matches_torch_fp32(monkeypatch, device, steps, T):
    B, H, G, D = 2, 4, 2, 16
    q, cache = inputs(device, torch.float32, B, T, H, G, D, steps, seed=T * 10 + steps)
    grad = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(1)).to(device)
    want, want_grads = run(monkeypatch, "0", q, cache, 0.3, grad)
    got, got_grads = run(monkeypatch, "force", q, cache, 0.3, grad)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_bf16_close_to_torch(monkeypatch, device):
    B, T, H, G, D, steps = 2, 45, 6, 2, 32, 3
    q, cache = inputs(device, torch.bfloat16, B, T, H, G, D, steps, seed=5)
    grad = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    ref32 = [(k.float(), v.float()) for k, v in cache]
    want, want_grads = run(monkeypatch, "0", q.float(), ref32, 0.2, grad.float())
    got, got_grads = run(monkeypatch, "force", q, cache, 0.2, grad)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.float(), b, atol=6e-2, rtol=5e-2)


def test_bad_shapes_raise():
    from eyas.kernels.ttt_attention import ttt_attention_forward

    q, k = torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="do not fit"):
        none = k.new_empty(0, 1, 4, 2, 16)
        ttt_attention_forward(q, k, torch.zeros(1, 5, 2, 16), none, none, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        ttt_attention_forward(q, torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16), k.new_empty(0, 1, 4, 3, 16),
                              k.new_empty(0, 1, 4, 3, 16), 1.0)


# hidden / MLP / head dim, tokens, TTT steps, gradient atol. Head dim 8 keeps the torch attention (the kernel
# takes 16 and up) under the loss and norm kernels; 16 runs every training kernel.
@pytest.mark.parametrize("hidden, inter, head_dim, T, steps, grad_atol", [(32, 64, 8, 12, 3, 1e-5),
                                                                         (64, 96, 16, 20, 4, 2e-5)])
def test_ttt_loss_and_gradients_are_the_same_with_the_kernels(monkeypatch, device, hidden, inter, head_dim, T,
                                                              steps, grad_atol):
    from eyas.draft_config import DraftConfig
    from eyas.models.eagle3 import Eagle3Draft
    from eyas.train.ttt import Teacher, TTTModel

    cfg = DraftConfig(hidden_size=hidden, intermediate_size=inter, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                      vocab_size=300, draft_vocab_size=120, target_hidden_size=hidden, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=256)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(device)
    B = 2
    embeds, features = torch.randn(B, T, hidden, device=device), torch.randn(B, T, 3 * hidden, device=device)
    probs = torch.softmax(torch.randn(B, T, 120, device=device), -1)
    teacher = Teacher(probs, probs.argmax(-1), torch.rand(B, T, device=device) > 0.3)

    def loss_and_grads(mode):
        monkeypatch.setenv("EYAS_KERNELS", mode)
        draft.zero_grad()
        loss, stats = TTTModel(draft, steps=steps)(embeds, features, teacher)
        loss.backward()
        return loss, stats, [p.grad.clone() for p in draft.parameters()]

    loss0, stats0, grads0 = loss_and_grads("0")
    loss1, stats1, grads1 = loss_and_grads("force")
    torch.testing.assert_close(loss1, loss0, atol=1e-5, rtol=1e-5)
    assert torch.equal(stats1["acc"], stats0["acc"])
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b, atol=grad_atol, rtol=1e-4)
