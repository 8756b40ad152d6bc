"""The speculation policy: fixed batch limit, and the adaptive choice from step costs and acceptance."""

import itertools

import eyas.engine.speculative as speculative
from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.spec_policy import SpecPolicy, bucket
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft, tiny_llama


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 64)] == [1, 2, 4, 8, 16, 64]


def test_fixed_limit():
    p = SpecPolicy(max_batch=8)
    assert p.speculate(8) and not p.speculate(9)


def test_measures_speculation_then_plain_then_chooses_by_the_cost_model():
    p = SpecPolicy(adaptive=True, probe_every=4, min_accept_cycles=3)
    for accept in (1.0, 2.0, 2.4):                   # nothing known: speculate (cost, and acceptance over 3 cycles)
        assert p.speculate(32) is True
        p.record(32, True, seconds=0.010, accept=accept)
    assert abs(p.accept - 1.8) < 1e-9                # their mean, not the first cycle's 1.0
    assert p.speculate(32) is False                  # then plain
    p.record(32, False, seconds=0.006)
    # 1.8 tokens per 10 ms cycle vs 1 token per 6 ms step: 1.08x, speculation chosen; plain tried every 4th
    assert abs(p.gain(32) - 1.08) < 1e-9
    choices = [p.speculate(32) for _ in range(8)]
    assert choices.count(True) == 6 and choices.count(False) == 2
    # acceptance fell (other traffic): 1.2 x 6 / 10 = 0.72x, plain chosen, speculation probed every 4th
    p.accept = 1.2
    choices = [p.speculate(32) for _ in range(8)]
    assert choices.count(False) == 6 and choices.count(True) == 2
    # far behind (< 0.7x): probed every 8 x 4 steps only
    p.accept = 1.0
    assert [p.speculate(32) for _ in range(64)].count(True) == 2


def test_acceptance_is_shared_by_all_batch_sizes_and_costs_are_not():
    p = SpecPolicy(adaptive=True, probe_every=1000, min_accept_cycles=1)
    p.record(1, True, seconds=0.002, accept=2.0)
    p.record(1, False, seconds=0.0015)
    p.record(64, True, seconds=0.020)
    p.record(64, False, seconds=0.008)
    assert p.speculate(1) is True     # 2.0 x 1.5 / 2 = 1.5x
    assert p.speculate(64) is False   # 2.0 x 8 / 20 = 0.8x
    assert p.speculate(33) is False   # same bucket as 64


def test_moving_averages_follow_a_change():
    p = SpecPolicy(adaptive=True, alpha=0.5, min_accept_cycles=1)
    p.record(4, True, seconds=0.01, accept=3.0)
    for _ in range(6):
        p.record(4, True, seconds=0.0, accept=1.0)  # untimed cycles still report their acceptance
    assert abs(p.accept - 1.0) < 0.05 and p.costs[(4, True)] == 0.01


def test_switches_only_past_the_margin():
    """Predictions a few percent apart do not flip the choice back and forth (each flip to speculation
    costs a catch-up pass); a clear difference does."""
    p = SpecPolicy(adaptive=True, probe_every=1000, margin=0.05, min_accept_cycles=1)
    p.record(2, True, seconds=1.0, accept=1.0)
    p.record(2, False, seconds=0.97)
    assert p.speculate(2) is False   # 0.97x
    p.accept = 1.04                  # 1.009x: within the margin, stay plain
    assert p.speculate(2) is False
    p.accept = 1.10                  # 1.067x: switch
    assert p.speculate(2) is True
    p.accept = 1.0                   # 0.97x: within the margin, keep speculating
    assert p.speculate(2) is True
    p.accept = 0.9
    assert p.speculate(2) is False


def test_forced_mode_is_measured_but_teaches_no_acceptance():
    """The engine's warm-up runs both modes on dummy prompts: their step times seed the costs, their
    acceptance says nothing about real traffic."""
    p = SpecPolicy(adaptive=True)
    p.forced = True
    assert p.speculate(8) is True
    p.record(8, True, seconds=0.004, accept=4.0)
    p.forced = False
    assert p.speculate(8) is False
    p.record(8, False, seconds=0.003)
    p.forced = None
    assert p.costs == {(8, True): 0.004, (8, False): 0.003} and p.accept is None
    assert p.speculate(8) is True  # acceptance unknown: measure it


def adaptive_engine(path):
    """A tiny target with a random draft under the adaptive policy."""
    tiny_llama(path, vocab=32, layers=4, hidden=64)
    return Engine(str(path), dtype="fp32", max_batch=4, max_len=128, draft=random_draft(64, 32, draft_vocab=24),
                  spec=SpecConfig(2, 1, adaptive=True))


def test_engine_times_a_step_until_the_next_start_over_the_same_batch(monkeypatch, tmp_path):
    """The decoder charges each step the time until the next step starts, and only while the batch
    stays the same: the step before a join (whose prefill runs in between) is not timed."""
    engine = adaptive_engine(tmp_path)
    clock = itertools.count(0.0, 0.5)  # every reading of the clock is 0.5 s after the last
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: next(clock))
    timed = []
    record = engine.spec.policy.record
    monkeypatch.setattr(engine.spec.policy, "record",
                        lambda n, spec, seconds, accept=None: (timed.append((n, seconds)) if seconds else None,
                                                               record(n, spec, seconds, accept)))
    engine.add([1, 2, 3], SamplingParams(max_tokens=40))
    for _ in range(4):
        engine.step()
    assert [n for n, _ in timed] == [1, 1, 1] and all(s == 0.5 for _, s in timed)
    engine.add([4, 5], SamplingParams(max_tokens=40))
    engine.step()  # the join: the last single-sequence step is not timed
    engine.step()
    assert [n for n, _ in timed] == [1, 1, 1, 2]


def test_a_plain_step_before_a_catch_up_is_timed_and_the_catch_up_is_not(monkeypatch, tmp_path):
    """A plain probe while speculating is followed by a catch-up pass: the probe's time ends where the
    catch-up starts, so the plain cost keeps being measured and neither mode is charged for the switch."""
    engine = adaptive_engine(tmp_path)
    policy = engine.spec.policy
    modes = iter([True, True, False, True, True])
    monkeypatch.setattr(policy, "speculate", lambda n: next(modes))
    clock = itertools.count(0.0, 1.0)
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: next(clock))
    caught = []
    catch_up = engine.spec._catch_up
    monkeypatch.setattr(engine.spec, "_catch_up", lambda seqs: (seqs and caught.append(len(seqs)), catch_up(seqs)))
    timed = []
    monkeypatch.setattr(policy, "record", lambda n, spec, seconds, accept=None: seconds and timed.append(spec))
    engine.add([1, 2, 3], SamplingParams(max_tokens=60))
    for _ in range(5):
        engine.step()
    assert caught == [1]                      # the plain step's pair, caught up before the 4th step
    assert timed == [True, True, False, True]  # every step followed by another over the same batch


def test_the_gpu_is_settled_before_a_step_that_follows_other_work(monkeypatch, tmp_path):
    """Work of another kind still queued on the GPU would be charged to the next timed step: the decoder
    waits for the GPU after a prefill, at a switch of mode and after a catch-up, and never between two
    steps of the same mode (where waiting would cost the overlap of host and GPU work)."""
    engine = adaptive_engine(tmp_path)
    modes = iter([True, True, True, False, False, True, True])
    monkeypatch.setattr(engine.spec.policy, "speculate", lambda n: next(modes))
    events = []
    monkeypatch.setattr(engine.spec, "_settle", lambda: events.append("settle"))
    catch_up = engine.spec._catch_up
    monkeypatch.setattr(engine.spec, "_catch_up", lambda seqs: (seqs and events.append("catch-up"), catch_up(seqs)))
    run = engine.spec._speculative_cycle, engine.spec._plain_step
    monkeypatch.setattr(engine.spec, "_speculative_cycle", lambda seqs: (events.append("spec"), run[0](seqs)))
    monkeypatch.setattr(engine.spec, "_plain_step", lambda seqs: (events.append("plain"), run[1](seqs)))
    engine.add([1, 2, 3], SamplingParams(max_tokens=60))
    for _ in range(7):
        engine.step()
    assert events == ["settle", "spec", "spec", "spec",      # after the prefill
                      "settle", "plain", "plain",            # a switch
                      "settle", "catch-up", "settle", "spec", "spec"]  # a switch, then the catch-up's own pass
