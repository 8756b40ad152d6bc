"""Launching the next cycle's draft and verify with this cycle's commit changes no token, and is used:
chain and tree, sequences finishing at different times, a request joining mid-run, greedy and sampled."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft, tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=32, layers=5, hidden=64)
    return str(path)


def _run(target_dir, spec, go_ahead):
    engine = Engine(target_dir, dtype="fp32", max_batch=4, max_len=256, draft=random_draft(64, 32, draft_vocab=24),
                    spec=spec)
    engine.spec.go_ahead = go_ahead
    used = []
    engine.spec._take_ahead = _counting(engine.spec._take_ahead, used)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=45),
              SamplingParams(max_tokens=30, temperature=0.8, seed=7)]
    seqs = [engine.add(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    for _ in range(6):
        engine.step()
    seqs.append(engine.add(prompts[2], params[2]))  # joins mid-run: the batch changes under a launched pass
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs], used


def _counting(take, used):
    def wrapped(seqs):
        out = take(seqs)
        used.append(out is not None)
        return out
    return wrapped


@pytest.mark.parametrize("spec", [SpecConfig(3, 1), SpecConfig(4, 3, 8)], ids=["chain", "tree"])
def test_going_ahead_changes_no_token(target_dir, spec):
    ahead, used = _run(target_dir, spec, True)
    plain, unused = _run(target_dir, spec, False)
    assert ahead == plain
    assert not any(unused)
    assert sum(used) > len(used) // 2   # most cycles were launched by the cycle before them
    assert not all(used)                # and the join, finishes and first cycles fell back
