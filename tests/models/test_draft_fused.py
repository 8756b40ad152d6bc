"""The EAGLE-3 draft's decode steps through the fused projection kernels (eyas.layers.fused_linear): q/k/v,
post-attention norm + gate/up, SiLU-and-mul + down and final norm + lm_head give what torch's ops give, the
kernels really run at one row, and more rows than MAX_ROWS or a draft that trains keep torch's ops.

EYAS_KERNELS=force runs the kernels on the CPU through Triton's interpreter (tests/conftest.py), so both
sides of each comparison run the same norm, rotary and attention kernels and differ only in the projections.
With EYAS_TEST_CUDA=1 the same tests run the compiled kernels on the GPU."""

import pytest
import torch

from eyas.layers.kv_cache import KVCache
from eyas.layers.attention import AttentionBatch
from tests.conftest import on_gpu
from tests.helpers import random_draft

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]' brings it)")

H, V, VD = 64, 32, 24
PREFIX = 3  # positions cached before the step under test
FUSED = ("norm_linear", "silu_mul_linear", "linear_rows")
DEVICE = "cuda" if on_gpu() else "cpu"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Forces the kernels on and counts the fused projection kernels' calls, by name. The tiny draft's
    projections are all narrow: NARROW_ROWS is set to 0 so that MAX_ROWS alone decides, as these tests say."""
    import eyas.kernels.fused_linear as kernels

    monkeypatch.setattr(kernels, "NARROW_ROWS", 0)
    monkeypatch.setenv("EYAS_KERNELS", "force")
    calls = dict.fromkeys(FUSED, 0)
    for name in FUSED:
        def counted(*args, _name=name, _kernel=getattr(kernels, name)):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@torch.no_grad()
def _step(draft, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logits) of a draft step of `rows` tokens at batch 1, after an extend pass over PREFIX positions."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, PREFIX + rows, H, generator=g).to(DEVICE)
    features = torch.randn(1, PREFIX, 3 * H, generator=g).to(DEVICE)
    heads, head_dim, shared = draft.config.kv_cache_layout()
    kv = KVCache(1, 1, PREFIX + rows, heads, head_dim, torch.float32, DEVICE, shared)

    def run(embeds, hidden, start, fuse):
        batch = AttentionBatch(kv=kv, slots=torch.tensor([0], device=DEVICE),
                               starts=torch.tensor([start], device=DEVICE), kv_len=start + embeds.shape[1])
        positions = torch.arange(start, start + embeds.shape[1], device=DEVICE)[None]
        return draft(embeds, hidden, positions, batch, fuse=fuse)

    out = run(embeds[:, :PREFIX], features, 0, fuse=True)
    out = run(embeds[:, PREFIX:], out[:, -rows:], PREFIX, fuse=False)
    return out, draft.logits(out)


def _fused_draft():
    return random_draft(H, V, draft_vocab=VD).to(DEVICE).fuse_projections()


def test_one_row_runs_the_fused_kernels_and_matches_torch(kernel_calls, plan):
    draft = _fused_draft()
    out, logits = _step(draft, 1)
    # q/k/v and o; the post-attention norm with gate/up and the final norm with lm_head; SiLU-and-mul with down
    # and the residual add after it.
    assert kernel_calls == {"linear_rows": 2, "norm_linear": 2, "silu_mul_linear": 1}
    plan(fused_linear=False)
    ref_out, ref_logits = _step(draft, 1)
    assert kernel_calls == {"linear_rows": 2, "norm_linear": 2, "silu_mul_linear": 1}
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_more_rows_than_max_rows_keep_torch(kernel_calls, plan):
    draft = _fused_draft()
    out, logits = _step(draft, 3)
    assert not any(kernel_calls.values())
    plan(fused_linear=False)
    ref_out, ref_logits = _step(draft, 3)
    assert torch.equal(out, ref_out) and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_training_head_keeps_torch(kernel_calls, autocast):
    """With gradients (training, under autocast on a GPU) the head is exactly lm_head(norm(out)), and trains."""
    draft = random_draft(H, V, draft_vocab=VD).to(DEVICE)
    out = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        logits = draft.head_output(out)
        ref = draft.lm_head(draft.norm(out))
    assert not any(kernel_calls.values())
    assert logits.dtype == ref.dtype and torch.equal(logits, ref)
    logits.float().sum().backward()
    assert draft.lm_head.weight.grad is not None and draft.norm.weight.grad is not None


@pytest.mark.parametrize("rows", [1, 3])
def test_step_fusions_give_the_separate_ops_result(kernel_calls, plan, rows):
    """The plan's draft_fusions (on by default): the fc and o projections through the GEMV tiles, the two input norms
    in one kernel and the residual add inside the down projection's kernel give what the separate ops give
    (the add bit for bit as torch rounds it, the projections to accumulation order)."""
    draft = _fused_draft()
    out, logits = _step(draft, rows)
    plan(draft_fusions=False)
    calls_before = dict(kernel_calls)
    ref_out, ref_logits = _step(draft, rows)
    assert kernel_calls["linear_rows"] - calls_before["linear_rows"] == (1 if rows == 1 else 0)  # q/k/v alone
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_draft_ids_embed_as_their_target_ids(monkeypatch, plan):
    """embed_ids: one kernel (forced here) or to_target_ids and the lookup, the same rows."""
    from eyas.layers.linear import VocabParallelEmbedding

    draft = random_draft(H, V, draft_vocab=VD).to(DEVICE)
    draft.d2t.copy_(torch.randint(0, V - VD + 1, (VD,), generator=torch.Generator().manual_seed(1)))
    embedding = VocabParallelEmbedding(V, H).to(DEVICE)
    embedding.weight.data.normal_()
    ids = torch.tensor([[0, 5, VD - 1], [3, 3, 7]], device=DEVICE)
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with torch.no_grad():
        fused = draft.embed_ids(ids, embedding)
        plan(draft_fusions=False)
        assert torch.equal(fused, draft.embed_ids(ids, embedding))
        assert torch.equal(fused, embedding.weight[ids + draft.d2t[ids]])
