"""The warm-up captures every CUDA graph that serving traffic replays, checked on the CPU with graphs faked.

A capture in the middle of traffic stalls every running request for several forwards. The CUDA test
(test_graphs.py) covers a few fixed batches; this one replays a loaded server's traffic, with graphs faked
(fake_cuda_graphs.py): requests join a running batch as others finish, prompts long enough for the eager
path and short enough for graphed chunks, rows past the long-row bound, and (adaptive) switches between
plain steps and speculation, greedy requests (decoded ahead of the host) among sampled ones.
"""

import random

import pytest

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import random_draft, tiny_llama


def _keys(engine):
    g = engine.runner.graphs
    cycles = {("cycle",) + key for key in engine.decoder.ahead.pairs} if engine.decoder else set()
    return set(g.graphs) | {("ahead",) + key for key in engine.ahead.pairs} | cycles


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=True)], ids=["plain", "adaptive"])
def test_join_heavy_traffic_after_warm_up_captures_nothing(tmp_path, fake_graphs, spec):
    tiny_llama(tmp_path, vocab=64, layers=3)  # graph keys do not depend on depth
    draft = random_draft(64, 64, draft_vocab=48) if spec else None
    engine = Engine(str(tmp_path), dtype="fp32", device="cpu", max_batch=8, max_len=1024, draft=draft, spec=spec,
                    cuda_graphs=False)
    fake_graphs(engine, rerun=False)  # which graphs exist, not what they compute (test_graph_bodies.py)
    assert engine.warm_up() > 0
    warm = _keys(engine)

    rng = random.Random(0)
    # Prompt lengths as in MT-bench with the chat template: mostly one or two chunks, some past the
    # graphed chunks' 256 tokens (eager), some whose rows grow past 512 columns.
    pending = [48, 245, 380, 60, 100, 286, 52, 402, 70, 233, 59, 300, 44, 130, 66, 90]

    def join():
        n = pending.pop(0)
        engine.add([rng.randrange(3, 60) for _ in range(n)],
                    SamplingParams(max_tokens=rng.choice([8, 60, 200]), ignore_eos=True,
                                   temperature=rng.choice([0.0, 0.0, 0.8])))  # greedy decode ahead, sampled in step

    for _ in range(6):
        join()
    while engine.has_work():
        for _ in engine.step():
            if pending:
                join()
    assert not pending
    assert _keys(engine) - warm == set()
