"""The speculation policy: the fixed batch limit, and the adaptive choice from measured rates per bucket."""

import eyas.engine.adaptive_steps as adaptive_steps
from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.spec_policy import SETTLE, SpecPolicy, bucket
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft, tiny_llama


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 64)] == [1, 2, 4, 8, 16, 64]


def test_fixed_limit():
    p = SpecPolicy(max_batch=8)
    assert p.speculate(8) and not p.speculate(9)


class Clock:
    """Drives a policy as the decoder does: each step is decided, started, and reports its tokens."""

    def __init__(self, policy: SpecPolicy):
        self.policy, self.now = policy, 0.0

    def steps(self, count, batch, seconds, tokens_per_seq) -> list[bool]:
        """`seconds` and `tokens_per_seq` may be dicts keyed by mode (True: speculative)."""
        modes = []
        for _ in range(count):
            if self.policy.boundary(batch):
                self.policy.close(self.now)
            mode = self.policy.speculate(batch)
            self.policy.step_started(batch, mode, self.now)
            pick = (lambda v: v[mode] if isinstance(v, dict) else v)
            self.now += pick(seconds)
            self.policy.step_done(round(batch * pick(tokens_per_seq)))
            modes.append(mode)
        return modes


def test_measures_a_window_of_each_mode_then_runs_the_faster():
    p = SpecPolicy(adaptive=True, window=4, probe_every=3)
    clock = Clock(p)
    # speculation: 2 tokens per 10 ms cycle (200/s per sequence); plain: 1 token per 4 ms step (250/s)
    modes = clock.steps(8, 2, {True: 0.010, False: 0.004}, {True: 2, False: 1})
    assert modes == [True] * 4 + [False] * 4
    assert abs(p.rates[(2, True)] - 200) < 1e-6      # the first window, closed when the second started
    modes = clock.steps(4 * 12, 2, {True: 0.010, False: 0.004}, {True: 2, False: 1})
    assert abs(p.gain(2) - 0.8) < 1e-6
    # a close call: speculation gets every second window until it has 4 windows' worth of steps ...
    windows = modes[::4]
    assert windows[:6] == [False, True] * 3 and p.measured[(2, True)] >= 4 * p.window
    # ... then plain, and speculation probed one window in every 3 (its rate stays current)
    assert windows[6:] == [False, False, True] * 2


def test_a_window_cut_short_does_not_decide_a_bucket_alone():
    """A first window of one step (a change of bucket cut it short, a switch's wait in it) books a rate, but
    the mode counts as measured at that bucket only once its windows there held a window's worth of steps:
    until then the policy keeps measuring it."""
    p = SpecPolicy(adaptive=True, window=4, probe_every=1000)
    clock = Clock(p)
    clock.steps(1, 2, 0.050, 1)           # one slow speculative step at bucket 2 (a stall in it) ...
    clock.steps(1, 1, 0.001, 1)           # ... cut short by a change of bucket
    assert (2, True) in p.rates and p.measured[(2, True)] == 1
    modes = clock.steps(9, 2, {True: 0.010, False: 0.004}, {True: 2, False: 1})
    # a window of speculation again (not plain on the strength of one step), then one of plain
    assert modes[:8] == [True] * 4 + [False] * 4
    assert p.measured == {(2, True): 5, (1, True): 1, (2, False): 4}


def test_rates_are_kept_per_bucket():
    p = SpecPolicy(adaptive=True, window=4, probe_every=1000)
    clock = Clock(p)
    fast_spec = ({True: 0.002, False: 0.002}, {True: 2, False: 1})    # 1000/s vs 500/s per sequence
    slow_spec = ({True: 0.040, False: 0.008}, {True: 2, False: 1})    # 50/s vs 125/s
    clock.steps(8, 1, *fast_spec)
    clock.steps(8, 64, *slow_spec)
    clock.steps(4, 1, *fast_spec)   # closes bucket 64's plain window
    assert clock.steps(4, 1, *fast_spec) == [True] * 4
    assert clock.steps(4, 64, *slow_spec) == [False] * 4
    assert clock.steps(4, 33, *slow_spec) == [False] * 4  # same bucket as 64


def test_rates_are_per_sequence():
    """Within one bucket, windows of a mode may see different batch sizes: rates are per running sequence."""
    p = SpecPolicy(adaptive=True, window=4)
    clock = Clock(p)
    clock.steps(4, 16, 0.010, 2)   # speculative: 16 sequences, 2 tokens each per 10 ms
    clock.steps(4, 9, 0.004, 1)    # plain: 9 sequences, 1 token each per 4 ms
    clock.steps(1, 16, 0.010, 2)
    assert abs(p.rates[(16, True)] - 200) < 1e-6 and abs(p.rates[(16, False)] - 250) < 1e-6


def test_switches_only_past_the_margin():
    """Rates a few percent apart do not flip the choice back and forth (each flip to speculation costs a
    catch-up pass); a clear difference does."""
    p = SpecPolicy(adaptive=True, probe_every=1000, margin=0.05)
    p.rates = {(2, True): 97.0, (2, False): 100.0}
    p.measured = {(2, True): SETTLE * p.window, (2, False): SETTLE * p.window}
    assert p.speculate(2) is False   # 0.97x
    p.rates[(2, True)] = 101.0       # within the margin: stay plain
    assert p.speculate(2) is False
    p.rates[(2, True)] = 107.0       # switch
    assert p.speculate(2) is True
    p.rates[(2, True)] = 97.0        # within the margin: keep speculating
    assert p.speculate(2) is True
    p.rates[(2, True)] = 90.0
    assert p.speculate(2) is False


def test_a_mode_far_behind_is_probed_less_often():
    p = SpecPolicy(adaptive=True, probe_every=4)
    p.rates = {(8, True): 75.0, (8, False): 100.0}   # 0.75x: far behind
    p.measured = {(8, True): SETTLE * p.window, (8, False): SETTLE * p.window}
    assert [p.speculate(8) for _ in range(32)].count(True) == 2   # every 4 x 4 windows
    p.rates[(8, True)] = 90.0                         # 0.9x: every 4 windows
    assert [p.speculate(8) for _ in range(32)].count(True) == 8


def test_a_close_call_on_one_window_is_measured_again_soon():
    """One window's acceptance depends on its text: a response's opening lines can accept far less than the
    rest. A close call on a first window of each mode gives the mode not chosen every second window until it
    has SETTLE windows' worth of steps, not one in probe_every (on an H200 a first speculative window at
    batch 1 read 0.84x plain and the policy decoded the rest of the response plain, at 0.86x of speculation)."""
    p = SpecPolicy(adaptive=True, window=4, probe_every=16)
    clock = Clock(p)
    clock.steps(4, 4, 0.0118, 1.5)    # speculation's opening: 127 tokens/s
    clock.steps(4, 4, 0.006, 1)       # plain: 167 tokens/s, 0.76x: plain, a close call
    modes = clock.steps(4 * 12, 4, {True: 0.0118, False: 0.006}, {True: 2.25, False: 1})  # then 191/s
    windows = modes[::4]
    assert windows[:4] == [False, True, False, True]
    # speculation now ahead; plain's rate does not depend on the text: it keeps the probe schedule
    assert p.preferred[4] is True and windows[-6:] == [True] * 6
    # the far side of a close call is probed on the slow schedule from the first windows on
    q = SpecPolicy(adaptive=True, window=4, probe_every=16)
    clock = Clock(q)
    clock.steps(8, 4, {True: 0.0118, False: 0.006}, {True: 1.0, False: 1})  # 0.51x
    assert clock.steps(4 * 8, 4, {True: 0.0118, False: 0.006}, {True: 1.0, False: 1}) == [False] * 32


def test_a_graph_capture_voids_its_window_and_stalls_count():
    p = SpecPolicy(adaptive=True, window=4)
    clock = Clock(p)
    for _ in range(4):  # a speculative window in which one step captured a graph
        p.step_started(1, True, clock.now)
        clock.now += 0.01
        p.step_done(2, captured_graph=clock.now > 0.025)
    p.close(clock.now)
    assert p.rates == {} and abs(p.seconds["void"] - 0.04) < 1e-9
    clock.steps(2, 1, 0.01, 2)
    clock.now += 0.06  # a stall between two steps (a join's prefill, the front end): the mode's time
    clock.steps(2, 1, 0.01, 2)
    clock.steps(1, 8, 0.01, 2)  # a new bucket closes bucket 1's window: 8 tokens in 0.1 s
    assert abs(p.rates[(1, True)] - 80) < 1e-6
    assert abs(p.seconds["speculative"] - 0.1) < 1e-9 and p.seconds["plain"] == 0.0


def test_a_window_cut_short_counts_for_its_share_of_steps():
    """A change of batch bucket (a join, a finish) cuts windows short, and those are the windows with the
    prefills in them: dropping them would hide the stalls, so they count, forgetting the old sums by a
    quarter of alpha for a quarter of a window."""
    p = SpecPolicy(adaptive=True, window=4, alpha=0.5)
    for start, steps, tokens in ((0.0, 4, 8), (1.0, 1, 1)):  # 8 tokens in 0.1 s, then 1 in 0.01 s
        for _ in range(steps):
            p.step_started(1, True, start)
            p.step_done(tokens // steps)
        p.close(start + 0.025 * steps if steps == 4 else start + 0.01)
    keep = 1 - 0.5 / 4
    assert abs(p.rates[(1, True)] - (keep * 8 + 1) / (keep * 0.1 + 0.01)) < 1e-6
    assert abs(p.seconds["speculative"] - 0.11) < 1e-9 and p.tokens["speculative"] == 9


def test_rates_weigh_windows_by_their_time():
    """A window with a long stall (a burst of prefills) weighs by its length: the rate is what the mode
    delivered over its recent windows, not the mean of their rates."""
    p = SpecPolicy(adaptive=True, window=4, alpha=0.5)
    for start, stall in ((0.0, 0.0), (1.0, 0.4)):  # 4 tokens in 0.04 s, then 4 in 0.44 s
        for i in range(4):
            p.step_started(1, True, start + 0.01 * i + (stall if i else 0.0))
            p.step_done(1)
        p.close(start + 0.04 + stall)
    expected = (0.5 * 4 + 4) / (0.5 * 0.04 + 0.44)   # 13.0/s; the mean of the two windows' rates: 54.5/s
    assert abs(p.rates[(1, True)] - expected) < 1e-6


def test_forced_mode_measures_nothing():
    """The engine's warm-up runs both modes on dummy prompts, whose acceptance says nothing of real traffic."""
    p = SpecPolicy(adaptive=True, window=2)
    p.forced = True
    clock = Clock(p)
    assert clock.steps(6, 8, 0.01, 3) == [True] * 6
    p.forced = False
    assert clock.steps(6, 8, 0.01, 1) == [False] * 6
    p.forced = True
    p.set_aside(0.5)  # a warm-up prefill
    p.forced = None
    assert p.rates == {} and p.speculate(8) is True
    assert sum(p.seconds.values()) == 0 and sum(p.tokens.values()) == 0


def test_warm_up_passes_leave_the_books_empty(tmp_path):
    """A server's first level reads the books before and after it; warm-up time (eager passes that compile
    kernels) booked as prefill or as a mode once made a level's books exceed its wall time."""
    engine = adaptive_engine(tmp_path)
    engine.warm_eager_passes()
    policy = engine.decoder.policy
    assert policy.rates == {} and policy.forced is None
    assert sum(policy.seconds.values()) == 0 and sum(policy.tokens.values()) == 0


def adaptive_engine(path):
    """A tiny target with a random draft under the adaptive policy."""
    tiny_llama(path, vocab=32, layers=4, hidden=64)
    return Engine(str(path), dtype="fp32", max_batch=4, max_len=128, draft=random_draft(64, 32, draft_vocab=24),
                  spec=SpecConfig(2, 1, adaptive=True))


class FakeClock:
    """perf_counter for the decoder: a speculative cycle takes 10 ms, a plain step 10 ms, a catch-up 100 ms
    and a prefill 2.5 ms; nothing else takes time."""

    def __init__(self, monkeypatch, engine):
        self.t = 0.0
        monkeypatch.setattr(adaptive_steps.time, "perf_counter", lambda: self.t)
        loop = engine.decoder.step_loop
        for owner, name, seconds in ((loop, "speculative_cycle", 0.01), (loop, "plain_step", 0.01),
                                     (loop, "catch_up", 0.1), (engine.decoder, "prefill", 0.0025)):
            monkeypatch.setattr(owner, name, self.taking(getattr(owner, name), seconds))

    def taking(self, fn, seconds):
        def run(seqs, *args):
            self.t += seconds if seqs else 0.0  # a catch-up of no sequences: no pass
            return fn(seqs, *args)
        return run


def test_engine_charges_the_gaps_between_steps_and_sets_prefills_aside(monkeypatch, tmp_path):
    """A window's time runs from its first step's start to the start of the step after its last, so the
    gaps between steps (in a server, the front end's work) are charged to the mode that ran; a join's
    prefill, the same work in either mode, is booked apart."""
    engine = adaptive_engine(tmp_path)
    engine.decoder.policy.window = 3
    fake = FakeClock(monkeypatch, engine)
    engine.add([1, 2, 3], SamplingParams(max_tokens=40))
    for _ in range(3):
        engine.step()
        fake.t += 0.005  # the front end's work after a step
    tokens = len(engine.running[0].output_ids) - 1  # the prefill's token is not a step's
    engine.add([4, 5], SamplingParams(max_tokens=40))
    engine.step()  # the join: its prefill, then a step of a new bucket, which closes the first window
    [(key, rate)] = engine.decoder.policy.rates.items()
    assert key == (1, True) and abs(rate - tokens / 0.045) < 1e-6  # 3 cycles and 3 gaps; one sequence
    assert abs(engine.decoder.policy.seconds["prefill"] - 0.005) < 1e-9  # both requests' prefills


def test_idle_time_is_charged_to_neither_mode(monkeypatch, tmp_path):
    """When the last request finishes the window ends there: the wait for the next request is nobody's."""
    engine = adaptive_engine(tmp_path)
    fake = FakeClock(monkeypatch, engine)
    [seq] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=7))
    [(key, rate)] = engine.decoder.policy.rates.items()
    cycles = seq.verify_passes
    assert key == (1, True) and abs(rate - (len(seq.output_ids) - 1) / (0.01 * cycles)) < 1e-6
    fake.t += 100.0  # nobody asks for anything for 100 s
    engine.generate([[4, 5, 6]], SamplingParams(max_tokens=7))
    assert engine.decoder.policy.rates[(1, True)] > rate / 2


def test_a_catch_up_is_charged_to_speculation(monkeypatch, tmp_path):
    """Speculating after plain steps first catches the draft up: that pass exists only to speculate, so the
    speculative window pays for it."""
    engine = adaptive_engine(tmp_path)
    policy = engine.decoder.policy
    policy.window = 2
    modes = iter([True, True, False, False, True, True, False])
    monkeypatch.setattr(policy, "speculate", lambda n: next(modes))
    FakeClock(monkeypatch, engine)
    seconds = []
    close = policy.close
    monkeypatch.setattr(policy, "close", lambda now: (policy.current and seconds.append(now - policy.current.start),
                                                      close(now)))
    engine.add([1, 2, 3], SamplingParams(max_tokens=60))
    for _ in range(7):
        engine.step()
    # speculative, plain, speculative with its 100 ms catch-up
    assert [round(x, 6) for x in seconds] == [0.02, 0.02, 0.12]
    assert set(policy.rates) == {(1, True), (1, False)}
    assert abs(policy.seconds["speculative"] - 0.14) < 1e-9 and abs(policy.seconds["plain"] - 0.02) < 1e-9


def test_the_gpu_is_settled_at_a_switch_of_mode_and_around_a_prefill(monkeypatch, tmp_path):
    """Work of the other mode still queued on the GPU would be charged to the new window, and a window's
    work to the prefill booked apart: the decoder waits for the GPU when the mode changes and around a
    prefill, never between two steps of one mode (where waiting would cost the overlap of host and GPU
    work)."""
    engine = adaptive_engine(tmp_path)
    modes = iter([True, True, True, False, False, True, True])
    monkeypatch.setattr(engine.decoder.policy, "speculate", lambda n: next(modes))
    events = []
    loop = engine.decoder.step_loop
    monkeypatch.setattr(loop, "settle", lambda: events.append("settle"))
    catch_up = loop.catch_up
    monkeypatch.setattr(loop, "catch_up", lambda seqs: (seqs and events.append("catch-up"), catch_up(seqs)))
    run = loop.speculative_cycle, loop.plain_step
    monkeypatch.setattr(loop, "speculative_cycle", lambda seqs: (events.append("spec"), run[0](seqs)))
    monkeypatch.setattr(loop, "plain_step", lambda seqs: (events.append("plain"), run[1](seqs)))
    engine.add([1, 2, 3], SamplingParams(max_tokens=60))
    for _ in range(7):
        engine.step()
    assert events == ["settle", "settle",                                # the prefill
                      "settle", "spec", "spec", "spec",                  # the first step
                      "settle", "plain", "plain",                        # a switch
                      "settle", "catch-up", "spec", "spec"]              # a switch: catch-up and cycle, one window


def test_closed_windows_are_kept_with_their_catch_up_time():
    """Each closed window is kept (the last RECENT) with its booked seconds and the catch-up time charged in it:
    what a benchmark reads to tell a stalled window from a slow mode."""
    p = SpecPolicy(adaptive=True, window=4)
    clock = Clock(p)
    clock.steps(4, 2, {True: 0.01, False: 0.005}, {True: 2.0, False: 1.0})  # speculative window: 4 x 10 ms
    p.caught_up(0.25)  # the first window is still open: it closes at the next step
    clock.steps(1, 2, 0.005, 1.0)  # closes the first window, opens a plain one
    p.close(clock.now)
    first, second = p.windows_closed()
    assert first["speculated"] and first["steps"] == 4 and first["tokens"] == 16
    assert abs(first["seconds"] - 0.04) < 1e-9 and first["catch_up"] == 0.25
    assert not second["speculated"] and second["steps"] == 1 and abs(second["seconds"] - 0.005) < 1e-9


def test_continues_foretells_the_choice_that_closing_the_window_leads_to():
    """At every boundary, continues(n, now) is true exactly when, after close(now), the next window runs the
    open window's mode: through the first measurements, probes, and preferences that flip as rates drift
    across the margin (noisy timings around a gain of 1)."""
    import random

    rng = random.Random(0)
    p = SpecPolicy(adaptive=True, window=4, probe_every=3, margin=0.05)
    now, checked, switches = 0.0, 0, 0
    for step in range(4000):
        batch = 2 if step < 3000 else 5  # a change of bucket too
        if p.boundary(batch):
            foretold = p.continues(batch, now)
            was = p.current.speculated if p.current is not None else None
            p.close(now)
            mode = p.speculate(batch)
            if was is not None and p.current is None:
                assert foretold == (mode == was and bucket(batch) == p.recent[-1].bucket), step
                checked += 1
                switches += mode != was
        else:
            mode = p.speculate(batch)
        p.step_started(batch, mode, now)
        now += (0.010 if mode else 0.005) * rng.uniform(0.8, 1.2)
        p.step_done(batch * (2 if mode else 1))
    assert checked > 900 and 50 < switches < checked  # both answers came up many times


def test_the_decoder_waits_at_a_boundary_only_when_the_mode_may_change(monkeypatch, tmp_path):
    """Windows of one mode follow each other without a wait for the GPU (the steps in flight are read in
    the next window), and every produced token is still booked once."""
    engine = adaptive_engine(tmp_path)
    policy = engine.decoder.policy
    policy.window, policy.probe_every = 2, 1000
    policy.rates = {(1, True): 10.0, (1, False): 100.0}  # plain far ahead: plain windows, no probe soon
    policy.sums = {(1, True): (1.0, 0.1), (1, False): (10.0, 0.1)}
    policy.measured = {(1, True): 2, (1, False): 2}
    events = []
    loop = engine.decoder.step_loop
    settle, drain = loop.settle, loop.drain_ahead
    monkeypatch.setattr(loop, "settle", lambda: (events.append("settle"), settle()))
    monkeypatch.setattr(loop, "drain_ahead", lambda: (events.append("drain"), drain()))
    run = loop.plain_step
    monkeypatch.setattr(loop, "plain_step", lambda seqs: (events.append("plain"), run(seqs)))
    seq = engine.add([1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_work():
        engine.step()
    # After the prefill (its waits) and the first boundary (no window open yet): 11 plain steps in windows
    # of 2 with no wait between them, and the wait when the engine runs out of work.
    assert events[events.index("plain"):] == ["plain"] * 11 + ["settle"]
    assert len(policy.recent) >= 5 and all(not w.speculated for w in policy.recent)
    assert sum(policy.tokens.values()) == len(seq.output_ids) - 1


def test_a_plain_rate_of_zero_does_not_stop_the_policy():
    """A window that read none of its own tokens (its steps still in flight when it closed) books a rate of
    0: the policy then prefers the other mode rather than divide by it."""
    p = SpecPolicy(adaptive=True, window=2, probe_every=1000)
    p.rates = {(1, True): 10.0, (1, False): 0.0}
    p.measured = {(1, True): 2, (1, False): 2}
    assert p.speculate(1) is True and p.gain(1) > 1


def test_a_bucket_new_to_plain_borrows_a_clear_lead_of_speculation_above():
    """A batch's tail passes through buckets where speculation is measured but plain decoding is not. Where
    the nearest larger bucket with both measured has speculation far ahead, the policy keeps speculating and
    measures plain only on the probe schedule, instead of a window of plain at once (on an H200, batch 64's
    tail spent 31 ms of a 394-ms run in such windows at buckets 16 and 4). A close call there, a lead only
    at a smaller bucket (speculation's lead shrinks as the batch grows), or none at all is measured as before."""
    p = SpecPolicy(adaptive=True, window=4, probe_every=3)
    p.rates = {(8, True): 150.0, (8, False): 100.0, (32, True): 110.0, (32, False): 100.0, (16, True): 140.0}
    p.measured = {key: p.window for key in p.rates}
    # bucket 16: 8 leads by 1.5x but 32, above, by 1.1x only: plain is measured
    assert p.speculate(16) is False
    p.rates[(32, True)] = 160.0   # 1.6x at 32: speculate, plain only every probe_every windows
    assert [p.speculate(16) for _ in range(6)] == [True, True, False, True, True, False]
    assert p.preferred[16] is True
    # no larger bucket with both measured (a smaller one does not count): plain is measured, as before
    q = SpecPolicy(adaptive=True, window=4, probe_every=3)
    q.rates = {(1, True): 300.0, (1, False): 100.0, (16, True): 140.0, (32, True): 120.0}
    q.measured = {key: q.window for key in q.rates}
    assert q.speculate(16) is False
    # the nearest larger bucket with both measured decides, past one with plain unmeasured (a batch's tail at
    # bucket 2 where bucket 4 had no plain window and bucket 8 a 1.8x lead)
    u = SpecPolicy(adaptive=True, window=4, probe_every=3)
    u.rates = {(2, True): 230.0, (4, True): 210.0, (8, True): 190.0, (8, False): 105.0, (16, True): 100.0,
               (16, False): 120.0}
    u.measured = {key: u.window for key in u.rates}
    assert [u.speculate(2) for _ in range(3)] == [True, True, False]
    u.rates[(8, False)] = 170.0  # a close call at the nearest: plain is measured, whatever lies beyond
    u.windows.clear()
    assert u.speculate(2) is False
    # the top bucket of a batch: a far lead at 32, below it, is not borrowed at 64 (borrowed, a batch of 64 would
    # take bucket 32's 1.66x and never measure plain, even where plain beats the fixed chain)
    t = SpecPolicy(adaptive=True, window=4, probe_every=3)
    t.rates = {(32, True): 166.0, (32, False): 100.0, (64, True): 100.0}
    t.measured = {key: t.window for key in t.rates}
    assert t.speculate(64) is False
    # plain far ahead nearby changes nothing: speculation is still measured first, then plain
    r = SpecPolicy(adaptive=True, window=4, probe_every=3)
    r.rates = {(8, True): 50.0, (8, False): 100.0}
    r.measured = {key: r.window for key in r.rates}
    assert r.speculate(16) is True
    r.rates[(16, True)], r.measured[(16, True)] = 40.0, r.window
    assert r.speculate(16) is False


def test_borrowed_choices_are_foretold_by_continues():
    """continues() works out the borrowed choice too: a run of speculative windows at a bucket new to plain
    has no wait between them, and the probe window of plain is foretold as a change."""
    p = SpecPolicy(adaptive=True, window=4, probe_every=3)
    p.rates = {(32, True): 150.0, (32, False): 100.0, (16, True): 140.0}
    p.measured = {key: p.window for key in p.rates}
    clock = Clock(p)
    foretold, modes = [], []
    for _ in range(6 * 4):
        if p.boundary(16) and p.current is not None:
            foretold.append(p.continues(16, clock.now))
        modes += clock.steps(1, 16, 0.010, {True: 2, False: 1})
    # borrowed, borrowed, plain's first window (the probe); then speculation 2x plain: probed far less often
    assert modes[::4] == [True, True, False, True, True, True]
    assert foretold == [True, False, False, True, True]
