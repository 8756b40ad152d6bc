"""Plain greedy decoding one step ahead of the host (eyas.engine.ahead.DecodeAhead), with CUDA graphs faked on the
CPU (each graph body runs twice per replay, as fake_cuda_graphs.py explains): the tokens and finish reasons
equal plain greedy decoding's through stops learned a step late, max_tokens, admissions, aborts and a change
of attention bound, and the mode really runs steps ahead."""

import pytest

import eyas.engine.ahead as ahead_mod
import eyas.engine.graphs as graphs_mod
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.conftest import on_gpu
from tests.engine.ahead_scenarios import (VOCAB, a_stop_learned_late, admission_and_abort_in_flight, prompts,
                                          reference)
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import tiny_llama

CUDA = on_gpu()  # compiled kernels, no interpreter


@pytest.fixture
def model(tmp_path):
    tiny_llama(tmp_path, vocab=VOCAB, layers=3, hidden=64)
    return str(tmp_path)


@pytest.fixture
def ahead(monkeypatch, plan, fake_graphs):
    """An engine factory with decoding ahead on, and a count of the graph pairs' replays."""
    plan(decode_ahead=True)
    replays = []
    real = ahead_mod.GraphPair.replay
    monkeypatch.setattr(ahead_mod.GraphPair, "replay", lambda self: replays.append(1) or real(self))

    def make(path, **kw):
        return fake_graphs(Engine(path, dtype="fp32", max_len=256, **kw))
    return make, replays


def test_tokens_equal_plain_greedy_and_steps_run_ahead(model, ahead):
    make, replays = ahead
    ps = prompts(4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 35, 3, 60)]
    eng = make(model, max_batch=4)
    got = [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)]
    assert got == reference(model, ps, params)
    assert len(replays) >= 60 - 1  # every decode step of the longest ran from the pair
    assert not eng.ahead.active and not eng.ahead.flights


def test_a_seeded_greedy_request_still_runs_ahead(model, ahead):
    """A seed means nothing to a greedy row (regen seeds every request): it must not keep the batch in step."""
    make, replays = ahead
    ps = prompts(2)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=7 + i) for i in range(2)]
    eng = make(model, max_batch=2)
    seqs = eng.generate(ps, params)
    assert [s.generator for s in seqs] == [None, None]
    assert [(s.output_ids, s.finish_reason) for s in seqs] == reference(model, ps, params)
    assert len(replays) >= 20 - 1


def test_a_stop_learned_a_step_late_drops_that_step_for_it_only(model, ahead):
    make, replays = ahead
    a_stop_learned_late(model, make(model, max_batch=4), at=6)
    assert replays


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_finished_row_rides_along_until_the_live_rows_fit_a_smaller_bucket(model, ahead, fake_graphs, finish):
    """Rows 3 and 2 of four finish early, by a stop token or by max_tokens: after row 3 the mode keeps all four
    rows and enqueues every step (the finished row frozen on the device, in a cache no longer than admission
    needs), after row 2 the two live rows move to the 2-row bucket. Every request gets plain greedy decoding's
    tokens."""
    _, replays = ahead
    ps = prompts(4, seed=1)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 30, 9, 3)]
    if finish == "stop":  # the tokens rows 3 and 2 emit first at indices 2 and 8
        free = reference(model, ps, [SamplingParams(max_tokens=30, ignore_eos=True)] * 4)
        params = [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[free[i][0][n - 1]] if n < 30 else [])
                  for i, n in enumerate((30, 30, 9, 3))]
    want = reference(model, ps, params)
    assert [len(o) for o, _ in want] == [30, 30, 9, 3]
    eng = fake_graphs(Engine(model, dtype="fp32", max_batch=4, max_len=max(len(p) for p in ps) + 30 + 1))
    seqs = [eng.add(p, sp) for p, sp in zip(ps, params)]
    kept = []
    while eng.has_work():
        eng.step()
        if seqs[3].finished and not seqs[2].finished:
            kept.append(eng.ahead.active and len(eng.ahead.seqs) == 4 and len(eng.ahead.flights) == 1)
    assert [(s.output_ids, s.finish_reason) for s in seqs] == want
    assert kept and all(kept)
    assert {key[0] for key in eng.ahead.pairs} == {4, 2}
    assert len(replays) >= 30 - 1


def test_admission_and_abort_while_steps_are_in_flight(model, ahead):
    make, _ = ahead
    eng = make(model, max_batch=4)
    admission_and_abort_in_flight(model, eng, eng.ahead, steps=6, max_tokens=30)


def test_a_new_attention_bound_moves_to_the_wider_pair(model, ahead, monkeypatch):
    """Rows that may cross the short-row bound need the other graph pair: the steps move to it in flight."""
    make, _ = ahead
    monkeypatch.setattr(graphs_mod, "SHORT_ROWS", 24)
    ps = prompts(2, seed=3)
    params = [SamplingParams(max_tokens=25, ignore_eos=True)] * 2
    eng = make(model, max_batch=2)
    got = [s.output_ids for s in eng.generate(ps, params)]
    assert got == [o for o, _ in reference(model, ps, params)]
    assert {key[1] for key in eng.ahead.pairs} == {24, 256}


def test_sampled_requests_and_the_switch_keep_the_usual_path(model, ahead, plan):
    make, replays = ahead
    eng = make(model, max_batch=2)
    eng.generate(prompts(1), SamplingParams(max_tokens=8, temperature=0.8, seed=1))
    assert not replays
    plan(decode_ahead=False)
    eng.generate(prompts(1), SamplingParams(max_tokens=8))
    assert not replays


@pytest.mark.skipif(not CUDA, reason="real CUDA graphs, pinned memory and events need a GPU (EYAS_TEST_CUDA=1)")
def test_on_a_gpu_the_tokens_equal_plain_greedy(model, plan):
    ps = prompts(4, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 35, 3, 60)]
    runs = []
    for on in (False, True):
        plan(decode_ahead=on)
        eng = Engine(model, dtype="fp32", device="cuda", max_batch=4, max_len=256)
        runs.append([(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)])
    assert runs[0] == runs[1]
    assert eng.ahead.pairs  # the second engine decoded ahead
