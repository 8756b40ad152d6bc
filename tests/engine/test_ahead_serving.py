"""A worker (eyas.dist.worker.Lockstep) applies serving's commands to an engine that decodes ahead of the host
(ahead.py; CUDA graphs faked on the CPU), plain, speculative or adaptive: requests join between steps, some finish on a
stop token or max_tokens, some are sampled, one is aborted mid-flight, as a loaded server's front end sends
them. Every greedy request streams exactly the tokens it gets alone; the aborted one a prefix of them."""

import queue
import random

import pytest
import torch

from eyas.config import SpecConfig
from eyas.dist.messages import Abort, AddRequest, Step
from eyas.dist.worker import Lockstep
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import random_draft, tiny_llama

VOCAB = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=VOCAB, layers=3, hidden=64, initializer_range=0.3)  # outputs that do not loop
    return str(path)


def alone(model, prompt, params):
    [seq] = Engine(model, dtype="fp32", max_batch=1, max_len=256).generate([prompt], params)
    return seq.output_ids, seq.finish_reason


@pytest.mark.parametrize("spec",
                         [None, SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False),
                          SpecConfig(3, 1, adaptive=True)],
                         ids=["plain", "chain", "tree", "adaptive"])
def test_serving_traffic_streams_what_each_request_gets_alone(model, monkeypatch, plan, fake_graphs, spec):
    plan(decode_ahead=True)
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    requests = []
    for i in range(10):
        prompt = torch.randint(0, VOCAB, (rng.randrange(3, 40),), generator=g).tolist()
        greedy = i % 4 != 3
        params = SamplingParams(max_tokens=rng.randrange(4, 50), ignore_eos=True,
                                temperature=0.0 if greedy else 0.8, seed=None if greedy else i)
        requests.append((f"r{i}", prompt, params))
    # Request r1 stops on a token it emits mid-way, a step or cycle late for the host.
    rid, prompt, params = requests[1]
    free, _ = alone(model, prompt, params)
    requests[1] = (rid, prompt, SamplingParams(max_tokens=params.max_tokens, ignore_eos=True,
                                               stop_token_ids=[free[len(free) // 2]]))
    draft = random_draft(64, VOCAB, draft_vocab=24) if spec else None
    engine = fake_graphs(Engine(model, dtype="fp32", max_batch=4, max_len=256, draft=draft, spec=spec))
    if spec is not None and spec.adaptive:  # short windows: both modes, switched between, under the traffic
        engine.decoder.policy.window, engine.decoder.policy.probe_every = 3, 2
    results = queue.Queue()
    worker = Lockstep(engine, 0, results)
    streamed: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    pending = list(requests)
    for _ in range(3):
        rid, prompt, params = pending.pop(0)
        worker.apply(AddRequest(rid, prompt, params))
    steps = 0
    while engine.has_work() or pending:
        worker.apply(Step())
        steps += 1
        for update in results.get_nowait().updates:
            streamed.setdefault(update.id, []).extend(update.new_ids)
            if update.finish_reason:
                finished[update.id] = update.finish_reason
        if steps % 3 == 0 and pending:  # joins while others run
            rid, prompt, params = pending.pop(0)
            worker.apply(AddRequest(rid, prompt, params))
        if steps == 7:  # the client of r0 leaves while its steps are in flight
            assert "r0" not in finished
            worker.apply(Abort("r0"))
    ahead = engine.decoder.ahead if spec else engine.ahead
    assert ahead.flights.sent > 0 if spec else ahead.pairs  # the mode ran
    assert not ahead.active
    if spec is not None and spec.adaptive:  # plain windows ran ahead too
        assert engine.ahead.flights.sent > 0 and not engine.ahead.active
        assert engine.decoder.policy.tokens["plain"] > 0 and engine.decoder.policy.tokens["speculative"] > 0
    for rid, prompt, params in requests:
        if not params.greedy:
            continue
        want, reason = alone(model, prompt, params)
        if rid == "r0":
            assert streamed[rid] == want[:len(streamed[rid])] and rid not in finished
        else:
            assert (streamed[rid], finished[rid]) == (want, reason), rid
    assert finished["r1"] == "stop"
