"""Greedy speculative cycles one ahead of the host (eyas.engine.ahead.SpecAhead), with CUDA graphs faked on the CPU
(each graph body runs twice per replay, as fake_cuda_graphs.py explains): chain and tree, the tokens and
finish reasons equal plain greedy decoding's through stops learned a cycle late, max_tokens, admissions,
aborts and batch buckets with padding rows, and the mode really keeps a cycle in flight."""

import pytest
import torch

import eyas.engine.graphs as graphs_mod
import eyas.engine.ahead as ahead_mod
from eyas.config import SpecConfig
from eyas.engine.draft_state import lag_features
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.conftest import on_gpu
from tests.engine.ahead_scenarios import (VOCAB, a_stop_learned_late, admission_and_abort_in_flight, prompts,
                                          reference)
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import random_draft, tiny_llama

CUDA = on_gpu()  # compiled kernels, no interpreter
SPECS = [SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=VOCAB, layers=3, hidden=64, initializer_range=0.3)  # outputs that do not loop
    return str(path)


@pytest.fixture(scope="module")
def draft():
    return random_draft(64, VOCAB, draft_vocab=24)


@pytest.fixture
def ahead(monkeypatch, plan, fake_graphs, model, draft):
    """An engine factory with decoding ahead on, and what its cycles did: the most in flight at once, and the
    furthest cache column a cycle wrote (read on the host here, as the engine itself never does)."""
    plan(decode_ahead=True)
    most = {"in_flight": 0, "column": 0}
    real = ahead_mod.SpecAhead._enqueue

    def enqueue(self):
        inputs = self.pair.current
        live = inputs.active.bool()
        most["column"] = max(most["column"], int(inputs.cached[live].max()) + self.decoder.spec.draft_tokens - 1)
        real(self)
        most["in_flight"] = max(most["in_flight"], len(self.flights))
    monkeypatch.setattr(ahead_mod.SpecAhead, "_enqueue", enqueue)

    def make(spec, max_batch=4):
        return fake_graphs(Engine(model, dtype="fp32", max_len=256, max_batch=max_batch, draft=draft, spec=spec))
    return make, most


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_tokens_equal_plain_greedy_and_cycles_run_ahead(model, ahead, spec):
    make, most = ahead
    ps = prompts(3)  # three rows in a bucket of four: a padding row rides along
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 41, 3)]
    eng = make(spec)
    got = [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)]
    assert got == reference(model, ps, params)
    assert most["in_flight"] == 2  # a cycle was enqueued while the one before was still unread
    assert not eng.decoder.ahead.active and not eng.decoder.ahead.flights


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_a_stop_learned_a_cycle_late_drops_that_cycle_for_it_only(model, ahead, spec):
    make, most = ahead
    a_stop_learned_late(model, make(spec), at=9)
    assert most["in_flight"] == 2


def oracle_chain(eng, refs: dict[tuple, list[int]], wrong_every: int = 5):
    """Replace the chain draft's guesses with the reference continuation, wrong at every fifth position
    (or never, with wrong_every=0): acceptance runs long and varies, so every path of the commit is taken
    (a random draft rarely accepts)."""
    decoder = eng.decoder
    real = decoder.draft_fn
    table = torch.zeros((eng.runner.kv.num_slots, 512), dtype=torch.long)

    def draft_fn(scores0, hidden0, root, c, slots, kv_len):
        tokens, parents, depth, mask = real(scores0, hidden0, root, c, slots, kv_len)
        for seq in eng.running:  # host work inside a graph body: fine where graphs are faked by re-running
            ref = refs[tuple(seq.prompt_ids)]
            table[seq.slot, :len(ref)] = torch.tensor(ref)
        cols = c[:, None] + 1 + torch.arange(tokens.shape[1] - 1)
        guess = table[slots[:, None], cols.clamp(max=table.shape[1] - 1)]
        if wrong_every:
            guess = torch.where(cols % wrong_every == 0, (guess + 1) % VOCAB, guess)
        return torch.cat([tokens[:, :1], guess], dim=1), parents, depth, mask
    decoder.draft_fn = draft_fn


def test_long_acceptance_through_an_oracle_draft(model, ahead):
    make, most = ahead
    ps = prompts(3, seed=5)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 50, 44)]
    want = reference(model, ps, params)
    eng = make(SpecConfig(4, 1, adaptive=False))
    oracle_chain(eng, {tuple(p): p + out for p, (out, _) in zip(ps, want)})
    got = eng.generate(ps, params)
    assert [(s.output_ids, s.finish_reason) for s in got] == want
    assert min(s.accept_length for s in got) > 2.5 and most["in_flight"] == 2


def test_admission_and_abort_while_cycles_are_in_flight(model, ahead):
    make, _ = ahead
    eng = make(SPECS[0])
    admission_and_abort_in_flight(model, eng, eng.decoder.ahead, steps=3, max_tokens=40)


def test_a_sampled_request_or_the_switch_off_keeps_the_usual_path(model, ahead, plan):
    make, most = ahead
    eng = make(SPECS[0], max_batch=2)
    eng.generate(prompts(1), SamplingParams(max_tokens=12, temperature=0.8, seed=1))
    assert most["in_flight"] == 0
    plan(decode_ahead=False)
    eng.generate(prompts(1), SamplingParams(max_tokens=12))
    assert most["in_flight"] == 0


def test_plain_steps_of_the_policy_drain_first(model, ahead):
    """A batch above the speculation limit takes plain steps; when it shrinks speculation resumes ahead."""
    make, most = ahead
    ps = prompts(3, seed=3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 40, 45)]
    eng = make(SpecConfig(3, 1, max_batch=2, adaptive=False))
    got = [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)]
    assert got == reference(model, ps, params)
    assert most["in_flight"] == 2


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_the_adaptive_policy_speculates_ahead_and_books_every_token(model, ahead, spec):
    """Under the adaptive policy both modes' windows run ahead; a window's end drains its cycles or steps into
    its own books, so every token a step produced is booked exactly once (the first of each sequence comes from
    its prefill), and the tokens still equal plain greedy decoding's through both modes' windows."""
    make, most = ahead
    ps = prompts(3, seed=5)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 61, 47)]
    eng = make(SpecConfig(spec.steps, spec.topk, spec.draft_tokens, adaptive=True))
    policy = eng.decoder.policy
    policy.window, policy.probe_every = 4, 2  # many windows, both modes, switches between them
    seqs = eng.generate(ps, params)
    assert [(s.output_ids, s.finish_reason) for s in seqs] == reference(model, ps, params)
    assert most["in_flight"] == 2  # speculative windows ran a cycle ahead
    assert eng.ahead.flights.sent > 0 and not eng.ahead.active  # and plain windows a step ahead
    assert policy.tokens["speculative"] > 0 and policy.tokens["plain"] > 0
    assert sum(policy.tokens.values()) == sum(len(s.output_ids) - 1 for s in seqs)
    assert policy.current is None and not eng.decoder.ahead.active


def test_plain_steps_ahead_hold_back_what_plain_steps_in_step_do(model, ahead, plan):
    """A speculative engine's plain steps ahead of the host leave each sequence the lag (tokens, and the
    target's features of each step) that plain steps in step leave it, after a stop learned a step late too."""
    make, most = ahead
    ps = prompts(3, seed=6)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 30, 30)]

    def run(ahead_on: bool):
        plan(decode_ahead=ahead_on)
        eng = make(SPECS[0])
        eng.decoder.policy.forced = False  # plain steps only
        seqs = [eng.add(p, q) for p, q in zip(ps, params)]
        for _ in range(14):
            eng.step()
        eng.drain_ahead()
        live = [s for s in seqs if not s.finished]
        assert len(live) == 2 and seqs[0].finish_reason == "length"
        return eng, [s.output_ids for s in seqs], [(list(s.draft_state.lag_tokens),
                                                    lag_features([s], len(s.draft_state.lag_tokens))) for s in live]

    eng, outputs, lags = run(True)
    assert eng.ahead.flights.sent > 0
    _, want_outputs, want_lags = run(False)
    # Each drain read the step still in flight, the last one and the move to the 2-row bucket when the first
    # request finished: the sequences running ahead may hold two more.
    assert [o[:len(w)] for o, w in zip(outputs, want_outputs)] == want_outputs
    for (tokens, feats), (want_tokens, want_feats) in zip(lags, want_lags):
        n = len(want_tokens)
        assert tokens[:n] == want_tokens and n >= 13 and len(tokens) <= n + 2
        torch.testing.assert_close(feats[:, :n], want_feats)


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_a_cycle_is_one_graph_replay(model, ahead, monkeypatch, spec):
    """Each cycle ahead of the host replays one whole-cycle graph and no phase graph (draft, verify, commit),
    and decodes plain greedy decoding's tokens."""
    make, most = ahead
    ps = prompts(3, seed=7)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (26, 33, 12)]
    want = reference(model, ps, params)
    phases = {"tree", "verify", "commit"}

    eng = make(spec)
    replays = []
    real = ahead_mod.GraphPair.replay
    monkeypatch.setattr(ahead_mod.GraphPair, "replay", lambda self: replays.append(self) or real(self))
    assert [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)] == want
    assert replays and eng.decoder.ahead.pairs and most["in_flight"] == 2  # a pair per bucket as the batch shrinks
    assert not phases & {key[0] for key in eng.runner.graphs.graphs}


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_rows_crossing_an_attention_bound_move_to_the_wider_pair_in_flight(model, ahead, monkeypatch, spec):
    """A row that may cross the short-row bound while cycles are in flight moves the state, on the device, to the
    pair of graphs of the wider bound without draining; the tokens stay plain greedy decoding's."""
    make, most = ahead
    monkeypatch.setattr(graphs_mod, "SHORT_ROWS", 40)
    ps = prompts(2, seed=3)
    params = [SamplingParams(max_tokens=45, ignore_eos=True)] * 2
    want = reference(model, ps, params)
    eng = make(spec, max_batch=2)
    moves = []  # cycles in flight when a pair took the state from another
    real = ahead_mod.SpecAhead._pair_for

    def pair_for(self, *args):
        pair = real(self, *args)
        if self.pair is not None and pair is not self.pair:
            moves.append(len(self.flights))
        return pair
    monkeypatch.setattr(ahead_mod.SpecAhead, "_pair_for", pair_for)
    assert [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)] == want
    assert {key[1] for key in eng.decoder.ahead.pairs} == {40, eng.decoder.kv.max_len}
    assert moves and max(moves) >= 1


@pytest.mark.skipif(not CUDA, reason="real CUDA graphs, pinned memory and events need a GPU (EYAS_TEST_CUDA=1)")
@pytest.mark.parametrize("spec", SPECS + [SpecConfig(3, 1, adaptive=True)], ids=["chain", "tree", "adaptive"])
def test_on_a_gpu_the_tokens_equal_plain_greedy(model, plan, spec):
    ps = prompts(4, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 35, 3, 60)]
    plain = Engine(model, dtype="fp32", device="cuda", max_batch=4, max_len=256)
    want = [(s.output_ids, s.finish_reason) for s in plain.generate(ps, params)]
    plan(decode_ahead=True)
    eng = Engine(model, dtype="fp32", device="cuda", max_batch=4, max_len=256,
                 draft=random_draft(64, VOCAB, draft_vocab=24), spec=spec)
    eng.decoder.policy.window, eng.decoder.policy.probe_every = 4, 2  # adaptive: windows of both modes
    assert [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)] == want
    assert not eng.decoder.ahead.active and eng.decoder.ahead.flights.sent > 0  # it ran ahead


def test_a_request_that_fills_the_context_never_writes_past_it(model, ahead):
    """prompt + max_tokens + lookahead == max_len, and every guess right, so the last cycle accepts past
    max_tokens: a cycle enqueued after it would write cache columns past the row's end; none is."""
    make, most = ahead
    spec = SpecConfig(4, 1, adaptive=False)
    ps = prompts(2, seed=6)
    params = [SamplingParams(max_tokens=256 - len(p) - spec.draft_tokens - 1, ignore_eos=True) for p in ps]
    want = reference(model, ps, params)
    longer = reference(model, ps, [SamplingParams(max_tokens=p.max_tokens + 8, ignore_eos=True) for p in params],
                       max_len=512)
    eng = make(spec, max_batch=2)
    oracle_chain(eng, {tuple(p): p + out for p, (out, _) in zip(ps, longer)}, wrong_every=0)
    got = eng.generate(ps, params)
    assert [(s.output_ids, s.finish_reason) for s in got] == want
    assert got[1].cached >= len(ps[1]) + params[1].max_tokens + 2  # the last cycle overshot (prompt of 17)
    assert most["in_flight"] == 2 and most["column"] < 256
