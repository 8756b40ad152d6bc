"""TTT is the inference chain, unrolled: step-k logits at index t equal what the KV-cache draft computes
when fed the same chain, and the loss pairs each step with the right target position and mask."""

import pytest
import torch

from eyas.layers.kv_cache import KVCache
from eyas.layers.attention import AttentionBatch
from eyas.train.ttt import TTTModel, teacher_from_logits, unroll
from tests.helpers import random_draft

V, VD, H = 32, 24, 64


def _inference_chain(draft, table, ids, feats, t, steps):
    """The slow reference: the draft's inference path (KV cache, AttentionBatch) one position at a time.
    Step 0 extends over the committed prefix 0..t; step k feeds its own previous output at position t+k."""
    heads, head_dim, shared = draft.config.kv_cache_layout()
    kv = KVCache(1, 1, t + steps + 1, heads, head_dim, torch.float32, "cpu", shared)

    def run(embeds, hidden, pos, start, fuse=False):
        batch = AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([start]),
                               kv_len=start + embeds.shape[0])
        return draft(embeds[None], hidden[None], pos[None], batch, fuse=fuse)

    out = run(table[ids[1: t + 2]], feats[: t + 1], torch.arange(t + 1), 0, fuse=True)
    h = out[:, -1:]
    logits = [draft.logits(h)[0, 0]]
    for k in range(1, steps):
        h = run(table[ids[t + 1 + k]][None], h[0], torch.tensor([t + k]), t + k)
        logits.append(draft.logits(h)[0, 0])
    return logits


@torch.no_grad()
def test_ttt_step_k_equals_inference_chain():
    draft = random_draft(H, V, draft_vocab=VD, seed=1)
    g = torch.Generator().manual_seed(0)
    B, T, K = 2, 11, 4
    table = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    feats = torch.randn(B, T, 3 * H, generator=g)
    outs = unroll(draft, table[ids], feats, K)
    ttt = [draft.logits(o) for o in outs]
    for b in range(B):
        for t in range(T - K):  # chains whose every token exists in the sequence
            ref = _inference_chain(draft, table, ids[b], feats[b], t, K)
            for k in range(K):
                torch.testing.assert_close(ttt[k][b, t], ref[k], atol=2e-5, rtol=1e-4,
                                           msg=f"step {k} index {t} row {b}")


@torch.no_grad()
def test_ttt_attention_ignores_other_positions_of_later_steps():
    """Changing the token at index j > t, or any index != t of steps >= 1, never changes index t."""
    draft = random_draft(H, V, draft_vocab=VD, seed=2)
    g = torch.Generator().manual_seed(1)
    T, K = 9, 3
    table = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    feats = torch.randn(1, T, 3 * H, generator=g)
    base = unroll(draft, table[ids], feats, K)
    feats2 = feats.clone()
    feats2[0, 6:] += 1.0  # features of later positions
    moved = unroll(draft, table[ids], feats2, K)
    for k in range(K):
        torch.testing.assert_close(base[k][0, :6], moved[k][0, :6])
        assert not torch.allclose(base[k][0, 6:], moved[k][0, 6:])


@torch.no_grad()
@pytest.mark.parametrize("weighted,temperature", [(False, 1.0), (True, 1.0), (False, 0.4)],
                         ids=["unweighted", "token-weights", "sharpened-teacher"])
def test_loss_pairs_step_k_with_target_position_t_plus_1_plus_k(weighted, temperature):
    """The loss equals a direct per-position sum: step k, index t uses z_{t+1+k}, masked by
    loss_mask[t+2+k] (the predicted token is the assistant's) and t2d[argmax z_{t+1+k}]; with token
    weights (train/repeats.py), a mean weighted by the weight of that predicted token x_{t+2+k}; with a
    teacher temperature T, the teacher is softmax(z / T) and the mask the same."""
    draft = random_draft(H, V, draft_vocab=VD, seed=3)
    g = torch.Generator().manual_seed(2)
    B, T, K, decay = 2, 10, 3, 0.8
    embeds = torch.randn(B, T, H, generator=g)
    feats = torch.randn(B, T, 3 * H, generator=g)
    logits = torch.randn(B, T, V, generator=g) * 3
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    used = draft.d2t + torch.arange(VD)
    token_weight = torch.rand(B, T, generator=g) if weighted else None
    teacher = teacher_from_logits(logits, loss_mask, used, draft.t2d, token_weight, temperature)
    total, stats = TTTModel(draft, K, decay)(embeds, feats, teacher)

    outs = unroll(draft, embeds, feats, K)
    want_total = 0.0
    for k in range(K):
        num, den, weights, hits = 0.0, 0, 0.0, 0
        for b in range(B):
            for t in range(T - 2 - k):
                p = t + 1 + k
                top = int(logits[b, p].argmax())
                if not (bool(loss_mask[b, p + 1]) and bool(draft.t2d[top])):
                    continue
                w = float(token_weight[b, p + 1]) if weighted else 1.0
                q = torch.softmax(logits[b, p, used] / temperature, -1)
                lp = torch.log_softmax(draft.logits(outs[k][b, t]), -1)
                num += w * float(-(q * lp).sum())
                den += 1
                weights += w
                hits += int(used[int(lp.argmax())] == top)
        assert int(stats["count"][k]) == den
        assert float(stats["loss"][k]) == pytest.approx(num / weights, rel=1e-5)
        assert float(stats["acc"][k]) == pytest.approx(hits / den)  # accuracy stays unweighted
        want_total += decay ** k * num / weights
    assert float(total) == pytest.approx(want_total, rel=1e-5)
