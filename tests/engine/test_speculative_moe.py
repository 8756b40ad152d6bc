"""Speculative greedy equals plain greedy (fp32) on a sparse-MoE target and on a latent-attention MoE target:
EAGLE-3 features are captured from these decoders, and tree verify + compaction work on the latent cache."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.profile import Profiler
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft
from tests.models.tiny_moe import save_tiny

VOCAB = 32  # small, so a random draft still gets tokens accepted


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def target_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path, vocab_size=VOCAB)
    return path


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_speculative_equals_greedy(target_dir, spec):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = [SamplingParams(max_tokens=n) for n in (20, 40, 40)]
    plain = Engine(str(target_dir), dtype="fp32", max_batch=3, max_len=256)
    want = [s.output_ids for s in plain.generate(prompts, params)]
    prof = Profiler("cpu")
    spec_engine = Engine(str(target_dir), dtype="fp32", max_batch=3, max_len=256, profiler=prof,
                         draft=random_draft(64, VOCAB, draft_vocab=24), spec=spec)
    assert spec_engine.target.capture_layers == (2, 2, 1)
    got = spec_engine.generate(prompts, params)
    assert [s.output_ids for s in got] == want
    assert max(prof.summary()["accept_histogram"]) > 1  # accepted drafts, so commit/compaction ran
