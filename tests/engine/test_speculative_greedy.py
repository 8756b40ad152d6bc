"""Speculative greedy output equals plain greedy output token for token (fp32), chain and tree."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.profile import Profiler
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft, tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=32, layers=5, hidden=64)
    return path


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(5, 4, 8, adaptive=False),
                                  SpecConfig(2, 3, 6, adaptive=False), SpecConfig(1, 1, adaptive=False),
                                  SpecConfig(3, 1, max_batch=2, adaptive=False), SpecConfig(3, 1, adaptive=True)],
                         ids=["chain", "tree", "tree-wide", "one-step", "off-above-2", "adaptive"])
def test_speculative_equals_greedy(target_dir, spec):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    # Different lengths, so the batch shrinks while running (the off-above-2 case then resumes speculating).
    params = [SamplingParams(max_tokens=n) for n in (20, 35, 60, 60)]
    plain = Engine(str(target_dir), dtype="fp32", max_batch=4, max_len=256)
    want = [s.output_ids for s in plain.generate(prompts, params)]
    prof = Profiler("cpu")
    spec_engine = Engine(str(target_dir), dtype="fp32", max_batch=4, max_len=256, profiler=prof,
                         draft=random_draft(64, 32, draft_vocab=24), spec=spec)
    spec_engine.decoder.policy.window = 2  # windows short enough for 60 tokens
    got = spec_engine.generate(prompts, params)
    assert [s.output_ids for s in got] == want
    summary = prof.summary()
    assert summary["cycles"] > 0 and summary["accept_length"] >= 1.0
    if spec.adaptive:
        # whatever it chose step by step, the output above was identical; it did try both modes
        policy = spec_engine.decoder.policy
        assert {speculated for (_, speculated) in policy.rates} == {True, False}
    elif spec.max_batch is None:
        # acceptance actually happened somewhere, so the commit/compaction path was exercised
        assert max(summary["accept_histogram"]) > 1
    else:
        # both plain steps (batch above the limit) and speculative cycles (after it shrank) ran
        speculative = prof.position_tries[1]
        assert 0 < speculative < summary["cycles"]
