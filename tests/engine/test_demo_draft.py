"""The bundled, trained SmolLM2 draft: speculative greedy equals plain greedy on real prompts (fp32, CPU),
with real acceptance, for the chain and the tree."""

import pytest

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
