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


def _draft_states(demo_dir, prompts, pattern=None):
    """Run the chain with a forced plain/speculative pattern (None: speculate at every step); returns the
    sequences and the draft's log-probs at the start of every speculative cycle, keyed by (prompt, cached
    length)."""
    engine = Engine(str(demo_dir), dtype="fp32", max_batch=2, max_len=512, draft=str(bundled_draft()),
                    spec=SpecConfig(3, 1, adaptive=False))
    if pattern is not None:
        it = iter(pattern * 100)
        upcoming = [next(it)]

        def forced(batch_size, peek=False):  # peek tells the next step's choice without taking it
            choice = upcoming[0]
            if not peek:
                upcoming[0] = next(it)
            return choice

        engine.decoder.policy.speculate = forced  # this engine's own policy: nothing to undo
    states, cycle = {}, engine.decoder.step_loop.speculative_cycle

    def recorded(seqs):
        for s in seqs:
            states[(s.id, s.cached)] = s.draft_state.scores.clone()
        cycle(seqs)

    engine.decoder.step_loop.speculative_cycle = recorded
    seqs = engine.generate(prompts, SamplingParams(max_tokens=48))
    return seqs, states


@pytest.fixture(scope="module")
def always(demo_dir, prompts):
    """The chain speculating at every step, its draft states recorded: the lossless test's chain run and the
    catch-up test's reference are the same run, made once."""
    return _draft_states(demo_dir, prompts)


@pytest.mark.skipif(bundled_draft() is None, reason="no bundled draft in assets/")
@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(5, 4, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_trained_draft_is_lossless_and_accepts(demo_dir, prompts, plain, spec, request):
    if spec == SpecConfig(3, 1, adaptive=False):
        seqs, _ = request.getfixturevalue("always")
    else:
        engine = Engine(str(demo_dir), dtype="fp32", max_batch=2, max_len=512, draft=str(bundled_draft()), spec=spec)
        seqs = engine.generate(prompts, SamplingParams(max_tokens=48))
    assert [s.output_ids for s in seqs] == plain
    assert sum(len(s.output_ids) - 1 for s in seqs) / sum(s.verify_passes for s in seqs) > 1.2


@pytest.mark.skipif(bundled_draft() is None, reason="no bundled draft in assets/")
def test_draft_catches_up_after_plain_steps(demo_dir, prompts, plain, always, monkeypatch):
    """Plain steps defer the draft; the catch-up pass (several pairs at once, also forced mid-stretch by a
    small LAG_FLUSH) must leave the draft exactly where speculating all along leaves it at the same length.
    (LAG_FLUSH only acts on plain steps, so the all-speculative reference does not depend on it.)"""
    import eyas.engine.catch_up as catch_up

    monkeypatch.setattr(catch_up, "LAG_FLUSH", 5)
    seqs, ref = always
    mixed_seqs, got = _draft_states(demo_dir, prompts, [False] * 7 + [True] * 3)
    assert [s.output_ids for s in seqs] == plain and [s.output_ids for s in mixed_seqs] == plain
    common = [k for k in got if k in ref and k[1] > len(prompts[k[0]])]  # past the first cycle after prefill
    assert len(common) >= 3
    for k in common:
        torch.testing.assert_close(got[k], ref[k], atol=1e-4, rtol=1e-4)
