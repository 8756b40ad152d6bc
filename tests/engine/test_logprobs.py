"""Log-probabilities of emitted tokens: the target's, whatever produced the token (a plain step, a chain or a
tree verify, greedy or sampled), equal to a teacher-forced pass over the same text, and never computed
unless asked for."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.server.tiny import predictable_pair

PROMPTS = [[5, 17, 99, 3], [250, 8, 41, 7, 19, 200]]
SPECS = {"plain": None, "chain": SpecConfig(3, 1, adaptive=False), "tree": SpecConfig(3, 2, 5, adaptive=False)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return predictable_pair(root / "target", root / "draft")


@pytest.fixture(scope="module")
def engines(pair):
    target, draft = pair
    return {name: Engine(str(target), dtype="fp32", device="cpu", draft=None if spec is None else str(draft),
                         spec=spec, max_batch=2, max_len=256)
            for name, spec in SPECS.items()}


def teacher_forced(engine, prompt, output) -> torch.Tensor:
    """log_softmax of the target's logits at every output position, from one pass over prompt + output."""
    ids = torch.tensor([prompt + output[:-1]])
    runner = engine.runner
    slot = runner.kv.allocate()
    try:
        out = runner.forward(ids, torch.arange(ids.shape[1])[None], [slot], [0])
    finally:
        runner.kv.free(slot)
    return torch.log_softmax(engine.target.logits(out.hidden[0, len(prompt) - 1:]).float(), -1)


def check_against_reference(engine, prompt, seq, top):
    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.output_ids)
    ref = teacher_forced(engine, prompt, seq.output_ids)
    for i, (t, lp) in enumerate(zip(seq.output_ids, seq.logprobs)):
        assert lp.token == t
        assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-4)
        assert len(lp.top) == top
        if top:
            values, ids = ref[i].topk(top)
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("top", [0, 3])
def test_greedy_logprobs_equal_with_and_without_speculation(engines, top):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=top)
    runs = {name: eng.generate([list(p) for p in PROMPTS], params) for name, eng in engines.items()}
    assert engines["chain"].decoder and any(s.accept_length > 1.2 for s in runs["chain"])  # drafts got accepted
    for name, seqs in runs.items():
        for p, s in zip(PROMPTS, seqs):
            check_against_reference(engines[name], p, s, top)
    for i in range(len(PROMPTS)):
        plain = runs["plain"][i]
        for name in ("chain", "tree"):
            spec = runs[name][i]
            assert spec.output_ids == plain.output_ids
            assert [lp.logprob for lp in spec.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs],
                                                                         abs=1e-5)
            assert [[t for t, _ in lp.top] for lp in spec.logprobs] == [[t for t, _ in lp.top] for lp in plain.logprobs]


@pytest.mark.parametrize("name", list(SPECS))
def test_sampled_logprobs_are_the_targets_of_the_emitted_tokens(engines, name):
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=7 + i, logprobs=2)
              for i in range(len(PROMPTS))]
    seqs = engines[name].generate([list(p) for p in PROMPTS], params)
    for p, s in zip(PROMPTS, seqs):
        check_against_reference(engines[name], p, s, 2)


def test_only_requests_that_ask_get_logprobs_and_a_stop_cuts_them(engines):
    asks = SamplingParams(max_tokens=7, ignore_eos=True, logprobs=1)  # 7: a chain cycle overshoots the limit
    quiet = SamplingParams(max_tokens=7, ignore_eos=True)
    a, b = engines["chain"].generate([list(PROMPTS[0]), list(PROMPTS[1])], [asks, quiet])
    assert len(a.output_ids) == len(a.logprobs) == 7
    assert b.logprobs is None


@pytest.mark.parametrize("name", list(SPECS))
def test_logprobs_not_computed_unless_asked(engines, monkeypatch, name):
    import eyas.engine.engine
    import eyas.engine.speculative

    def forbidden(*a, **k):
        raise AssertionError("log-probabilities computed for a request that did not ask")

    monkeypatch.setattr(eyas.engine.engine, "token_logprobs", forbidden)
    monkeypatch.setattr(eyas.engine.speculative, "token_logprobs", forbidden)
    for params in (SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, seed=1)):
        [seq] = engines[name].generate([list(PROMPTS[0])], params)
        assert seq.logprobs is None and len(seq.output_ids) == 8
