"""The bundled, trained SmolLM2 draft: speculative greedy equals plain greedy on real prompts (fp32, CPU),
with real acceptance, for the chain and the tree."""

import pytest
import torch

from eyas.commands.demo import bundled_draft
from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from eyas.models.tokenizer import encode_prompt, load_tokenizer

QUESTIONS = ["Give me three tips for staying focused while studying.", "What is the difference between a list and a tuple in Python?"]


@pytest.fixture(scope="module")
def prompts(demo_dir):
    tok = load_tokenizer(demo_dir)
    return [encode_prompt(tok, q, chat=True) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(demo_dir, prompts):
    engine = Engine(str(demo_dir), dtype="fp32", max_batch=2, max_len=512)
    return [s.output_ids for s in engine.generate(prompts, SamplingParams(max_tokens=48))]


@pytest.mark.skipif(bundled_draft() is None, reason="no bundled draft in assets/")
@pytest.mark.parametrize("spec", [SpecConfig(3, 1), SpecConfig(5, 4, 8)], ids=["chain", "tree"])
def test_trained_draft_is_lossless_and_accepts(demo_dir, prompts, plain, spec):
    engine = Engine(str(demo_dir), dtype="fp32", max_batch=2, max_len=512, draft=str(bundled_draft()), spec=spec)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=48))
    assert [s.output_ids for s in seqs] == plain
    assert sum(len(s.output_ids) - 1 for s in seqs) / sum(s.verify_passes for s in seqs) > 1.2


def _draft_states(demo_dir, prompts, monkeypatch, pattern=None):
    """Run with a forced plain/speculative pattern; returns outputs and the draft's log-probs at the
    start of every speculative cycle, keyed by (prompt, cached length)."""
    engine = Engine(str(demo_dir), dtype="fp32", max_batch=2, max_len=512, draft=str(bundled_draft()),
                    spec=SpecConfig(3, 1))
    if pattern is not None:
        it = iter(pattern * 100)
        upcoming = [next(it)]

        def forced(batch_size, peek=False):  # peek tells the next step's choice without taking it
            choice = upcoming[0]
            if not peek:
                upcoming[0] = next(it)
            return choice

        monkeypatch.setattr(engine.spec.policy, "speculate", forced)
    states, cycle = {}, engine.spec._speculative_cycle

    def recorded(seqs):
        for s in seqs:
            states[(s.id, s.cached)] = s.draft_state.logp.clone()
        cycle(seqs)

    monkeypatch.setattr(engine.spec, "_speculative_cycle", recorded)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=48))
    return [s.output_ids for s in seqs], states


@pytest.mark.skipif(bundled_draft() is None, reason="no bundled draft in assets/")
def test_draft_catches_up_after_plain_steps(demo_dir, prompts, plain, monkeypatch):
    """Plain steps defer the draft; the catch-up pass (several pairs at once, also forced mid-stretch by a
    small LAG_FLUSH) must leave the draft exactly where speculating all along leaves it at the same length."""
    import eyas.engine.speculative as speculative

    monkeypatch.setattr(speculative, "LAG_FLUSH", 5)
    always, ref = _draft_states(demo_dir, prompts, monkeypatch)
    mixed, got = _draft_states(demo_dir, prompts, monkeypatch, [False] * 7 + [True] * 3)
    assert always == plain and mixed == plain
    common = [k for k in got if k in ref and k[1] > len(prompts[k[0]])]  # past the first cycle after prefill
    assert len(common) >= 3
    for k in common:
        torch.testing.assert_close(got[k], ref[k], atol=1e-4, rtol=1e-4)
