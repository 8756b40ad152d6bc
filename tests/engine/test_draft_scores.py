"""The draft's state keeps scores whose log_softmax is its log-probs (Drafter.scores): the head's logits with
step fusions on, fp32 log-probs with the plan's draft_fusions=False. The chain and the tree draft the same candidates
from either, and a whole generation is the same."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams


def _engine(pair, spec):
    target, draft = pair
    return Engine(str(target), dtype="fp32", device="cpu", draft=str(draft), spec=spec, max_batch=3, max_len=256)


def _prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 21, 9)]


def test_scores_are_logits_with_fusions_and_log_probs_without(pair, plan):
    drafter = _engine(pair, SpecConfig(3, 1, adaptive=False)).decoder.drafter
    h = torch.randn(2, drafter.draft.config.hidden_size)
    logits = drafter.draft.logits(h)
    torch.testing.assert_close(drafter.scores(h).float(), logits)
    plan(draft_fusions=False)
    logp = drafter.scores(h)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, torch.log_softmax(logits, dim=-1))


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_drafts_from_logits_equal_drafts_from_log_probs(pair, spec):
    engine = _engine(pair, spec)
    # A random head's scores are near uniform, so the last bits of either form's rounding would pick between
    # near-tied candidates; a sharper head keeps the test on what it checks (the two forms, not rounding).
    with torch.no_grad():
        engine.decoder.drafter.draft.lm_head.weight.mul_(8)
    real, cycles = engine.decoder.draft_fn, []

    def both(scores0, *rest):
        from_logits = real(scores0, *rest)
        from_logp = real(torch.log_softmax(scores0.float(), dim=-1), *rest)
        for a, b in zip(from_logits, from_logp):
            assert torch.equal(a, b)
        cycles.append(1)
        return from_logits

    engine.decoder.draft_fn = both
    engine.generate(_prompts(1), SamplingParams(max_tokens=32, ignore_eos=True))
    assert len(cycles) >= 8


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_generation_is_the_same_with_and_without_fusions(pair, spec, plan):
    def run():
        seqs = _engine(pair, spec).generate(_prompts(2), SamplingParams(max_tokens=40, ignore_eos=True))
        return [s.output_ids for s in seqs], [s.verify_passes for s in seqs]

    fused = run()
    plan(draft_fusions=False)
    assert run() == fused
