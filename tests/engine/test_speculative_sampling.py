"""Speculative sampling preserves the target's distribution: chi-square over the joint of three sampled tokens."""


import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.runner import ModelRunner
from eyas.layers.sampling import SamplingParams, adjusted_probs
from tests.helpers import random_draft, tiny_llama

VOCAB, PROMPT, SAMPLES = 8, [1, 5, 2, 7], 3000
PARAMS = dict(temperature=0.9, top_p=0.95, top_k=6)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny8")
    tiny_llama(path, vocab=VOCAB, layers=4, hidden=32)
    return path


def exact_joint(engine) -> dict:
    """P(t1, t2, t3 | prompt) under the target's adjusted distribution, by enumeration."""
    runner = ModelRunner(engine.target, 1, 64, "cpu")

    def probs(prefix):
        ids = torch.tensor([prefix])
        out = runner.forward(ids, torch.arange(len(prefix))[None], [0], [0])
        return adjusted_probs(engine.target.logits(out.hidden[0, -1]), **PARAMS)

    joint = {}
    p1 = probs(PROMPT)
    for a in range(VOCAB):
        if p1[a] == 0:
            continue
        p2 = probs(PROMPT + [a])
        for b in range(VOCAB):
            if p2[b] == 0:
                continue
            p3 = probs(PROMPT + [a, b])
            for c in range(VOCAB):
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def chi_square_p(observed: dict, expected: dict, n: int) -> float:
    cells, stat, rest_o, rest_e = 0, 0.0, 0, 0.0
    for key, p in expected.items():
        e = p * n
        if e >= 5:
            stat += (observed.get(key, 0) - e) ** 2 / e
            cells += 1
        else:
            rest_o += observed.get(key, 0)
            rest_e += e
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    assert sum(v for k, v in observed.items() if k not in expected) == 0, "sampled a token of zero probability"
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(2, 3, 6, adaptive=False)],
                         ids=["chain", "tree"])
def test_speculative_sampling_matches_target_distribution(target_dir, spec):
    engine = Engine(str(target_dir), dtype="fp32", max_batch=64, max_len=64, spec=spec,
                    draft=random_draft(32, VOCAB, draft_vocab=6, seed=3))
    expected = exact_joint(engine)
    params = [SamplingParams(max_tokens=3, seed=i, **PARAMS) for i in range(SAMPLES)]
    seqs = engine.generate([PROMPT] * SAMPLES, params)
    observed = {}
    for s in seqs:
        key = tuple(s.output_ids[:3])
        observed[key] = observed.get(key, 0) + 1
    # draft tokens were accepted in a good share of runs, so acceptance (not only the residual) is tested
    accepted = sum(s.accept_length > 1 for s in seqs) / SAMPLES
    assert accepted > 0.05, accepted
    assert chi_square_p(observed, expected, SAMPLES) > 1e-3
