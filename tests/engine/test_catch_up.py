"""Catching the draft up after plain steps: one padded pass over sequences whose lags differ gives each
sequence the draft state that a pass of its own gives, rows near the end of their cache included."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.catch_up import catch_up, in_one_eager_pass
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import random_draft, tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=32, layers=3, hidden=64)
    return path


def ragged_lags(engine):
    """Three running sequences whose lags differ (21-ish, 7-ish, 2), one of them near its cache row's end."""
    engine.decoder.policy.forced = False  # plain steps only: every step adds to each sequence's lag
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, 32, (n,), generator=g).tolist()  # noqa: E731
    engine.add(prompt(5), SamplingParams(max_tokens=40))
    for _ in range(20):
        engine.step()
    engine.add(prompt(9), SamplingParams(max_tokens=30))
    for _ in range(6):
        engine.step()
    engine.add(prompt(54), SamplingParams(max_tokens=4))  # its row ends right after its lag
    engine.step()
    engine.step()
    seqs = list(engine.running)
    lags = [len(s.draft_state.lag_tokens) for s in seqs]
    assert len(set(lags)) == 3, lags
    return seqs, lags


def test_catch_up_over_ragged_lags_matches_a_pass_per_sequence(target_dir):
    engine = Engine(str(target_dir), dtype="fp32", max_batch=4, max_len=64,
                    draft=random_draft(64, 32, draft_vocab=24), spec=SpecConfig(3, 1, adaptive=False))
    seqs, lags = ragged_lags(engine)
    L, kv = max(lags), engine.decoder.kv
    assert any(s.cached - n + L > kv.max_len for s, n in zip(seqs, lags))  # the unpadded branch runs too

    states = [s.draft_state for s in seqs]
    want = []
    for s, state in zip(seqs, states):
        catch_up(engine.decoder, [s])
        want.append((s.draft_state.hidden.clone(), s.draft_state.scores.clone()))
        s.draft_state = state
    catch_up(engine.decoder, seqs)
    for s, (h, scores) in zip(seqs, want):
        assert not s.draft_state.lag_tokens
        torch.testing.assert_close(s.draft_state.hidden, h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.draft_state.scores, scores, atol=1e-5, rtol=1e-5)


def test_warm_up_runs_the_eager_passes_that_would_compile_in_traffic(tmp_path, monkeypatch):
    """Engine.warm_up (CUDA) ends with warm_eager_passes: short prefills and, with a draft, a switch from
    plain steps to speculation at each query length the kernel has a variant for, over short and long
    rows. The logic runs the same on the CPU: here it must catch up exactly those lags and leave the
    engine idle, every slot free and the policy as it was."""
    tiny_llama(tmp_path, vocab=32, layers=4, hidden=64)
    engine = Engine(str(tmp_path), dtype="fp32", max_batch=2, max_len=640, draft=random_draft(64, 32, draft_vocab=24),
                    spec=SpecConfig(2, 1, adaptive=True))
    lags, starts = [], []
    real = engine.decoder.step_loop.catch_up
    monkeypatch.setattr(engine.decoder.step_loop, "catch_up", lambda seqs: (
        seqs and (lags.append([len(s.draft_state.lag_tokens) for s in seqs]),
                  starts.append(seqs[0].cached - len(seqs[0].draft_state.lag_tokens))), real(seqs)))
    free = engine.runner.kv.free_slots
    engine.warm_eager_passes(long_rows=True)
    assert lags == [[2], [8], [12], [16]] * 2
    assert [s >= 512 for s in starts] == [False] * 4 + [True] * 4
    assert not engine.has_work() and engine.runner.kv.free_slots == free
    assert engine.decoder.policy.forced is None and engine.decoder.policy.rates == {}


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)],
                         ids=["chain", "tree"])
def test_graphed_passes_of_s_plus_1_pairs_match_the_eager_pass(target_dir, fake_graphs, spec):
    """With CUDA graphs the catch-up runs in passes of S+1 pairs through the sampled cycle's extend graph
    (no new shape per rows and lag): each row ends with the draft state one eager pass gives it."""
    engine = fake_graphs(Engine(str(target_dir), dtype="fp32", max_batch=4, max_len=64,
                                draft=random_draft(64, 32, draft_vocab=24), spec=spec))
    seqs, lags = ragged_lags(engine)
    assert max(lags) > 2 * (spec.steps + 1)  # several passes, rows dropping out after their last pair
    states = [s.draft_state for s in seqs]
    in_one_eager_pass(engine.decoder, seqs)
    want = [(s.draft_state.hidden.clone(), s.draft_state.scores.clone()) for s in seqs]
    for s, state in zip(seqs, states):
        s.draft_state = state
    keys = set(engine.runner.graphs.graphs)
    catch_up(engine.decoder, seqs)
    new = set(engine.runner.graphs.graphs) - keys
    assert new <= {k for k in engine.runner.graphs.graphs if k[0] == "extend"}
    for s, (h, scores) in zip(seqs, want):
        assert not s.draft_state.lag_tokens
        torch.testing.assert_close(s.draft_state.hidden, h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.draft_state.scores, scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)],
                         ids=["chain", "tree"])
def test_wide_passes_match_the_eager_pass_and_capture_nothing(target_dir, fake_graphs, monkeypatch, spec):
    """After warm_wide_passes the catch-up takes WIDE-column passes where every row's pass fits in its cache
    row (30 here, so that the row near its end forces an S+1 pass first), replays only graphs captured at
    warm-up for them, and each row ends with the draft state one eager pass gives it."""
    import eyas.engine.catch_up as catch_up_mod

    monkeypatch.setattr(catch_up_mod, "WIDE", 30)
    engine = fake_graphs(Engine(str(target_dir), dtype="fp32", max_batch=4, max_len=64,
                                draft=random_draft(64, 32, draft_vocab=24), spec=spec))
    catch_up_mod.warm_wide_passes(engine.decoder, max_batch=4)
    seqs, lags = ragged_lags(engine)
    assert max(s.cached - n for s, n in zip(seqs, lags)) + 30 > engine.decoder.kv.max_len  # no wide first pass
    states = [s.draft_state for s in seqs]
    in_one_eager_pass(engine.decoder, seqs)
    want = [(s.draft_state.hidden.clone(), s.draft_state.scores.clone()) for s in seqs]
    for s, state in zip(seqs, states):
        s.draft_state = state
    widths, extend = [], engine.decoder.extend
    monkeypatch.setattr(engine.decoder, "extend", lambda group, ids, *a: (widths.append(ids.shape[1]),
                                                                          extend(group, ids, *a)))
    graphs = engine.runner.graphs.graphs
    keys = set(graphs)
    catch_up(engine.decoder, seqs)
    assert widths[0] == spec.steps + 1 and 30 in widths  # the row near its end first, then a wide pass
    assert all(k[3][0] != (30,) for k in set(graphs) - keys)  # no wide graph captured in traffic
    for s, (h, scores) in zip(seqs, want):
        assert not s.draft_state.lag_tokens
        torch.testing.assert_close(s.draft_state.hidden, h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.draft_state.scores, scores, atol=1e-5, rtol=1e-5)
