"""The speculation policy: fixed batch limit, and the adaptive choice from measured throughput."""

from eyas.engine.spec_policy import SpecPolicy, bucket


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 64)] == [1, 2, 4, 8, 16, 64]


def test_fixed_limit():
    p = SpecPolicy(max_batch=8)
    assert p.speculate(8) and not p.speculate(9)


def test_adaptive_measures_both_then_keeps_the_faster_and_still_explores():
    p = SpecPolicy(adaptive=True, explore_every=4)
    # batch 32: speculation measured first, then plain; plain is faster there
    assert p.speculate(32) is True
    p.record(32, True, tokens=80, seconds=1.0)
    assert p.speculate(32) is False
    p.record(32, False, tokens=96, seconds=1.0)
    choices = [p.speculate(32) for _ in range(8)]
    assert choices.count(False) == 6 and choices.count(True) == 2  # the slower mode is retried every 4th step
    p.rates[(32, True)] = 40.0  # far behind (< 0.7x): retried every 8 * 4 steps only
    choices = [p.speculate(32) for _ in range(64)]
    assert choices.count(True) == 2
    # batch 1 is its own bucket: speculation is faster there
    assert p.speculate(1) is True
    p.record(1, True, tokens=300, seconds=1.0)
    assert p.speculate(1) is False
    p.record(1, False, tokens=200, seconds=1.0)
    assert p.speculate(1) is True


def test_moving_average_follows_a_change():
    p = SpecPolicy(adaptive=True, alpha=0.5)
    p.record(4, True, 100, 1.0)
    p.record(4, False, 80, 1.0)
    for _ in range(5):  # speculation got slower (say, acceptance fell with new traffic)
        p.record(4, True, 40, 1.0)
    assert p.rates[(4, True)] < p.rates[(4, False)]


def test_switches_only_past_the_margin():
    """Measurements a few percent apart do not flip the choice back and forth (each flip to speculation
    costs a catch-up pass); a clear difference does."""
    p = SpecPolicy(adaptive=True, explore_every=1000, margin=0.05)
    p.record(2, True, 100, 1.0)
    p.record(2, False, 97, 1.0)
    assert p.speculate(2) is True
    p.rates[(2, False)] = 103.0  # plain now 3% ahead: within the margin, keep speculating
    assert p.speculate(2) is True
    p.rates[(2, False)] = 110.0  # 10% ahead: switch
    assert p.speculate(2) is False
    p.rates[(2, True)] = 112.0   # speculation 2% ahead again: stay with plain
    assert p.speculate(2) is False


def test_peek_tells_the_next_decision_without_counting_it():
    p = SpecPolicy(adaptive=True, explore_every=4)
    p.record(8, True, 100, 1.0)
    p.record(8, False, 90, 1.0)
    for _ in range(10):
        told = p.speculate(8, peek=True)
        assert p.speculate(8, peek=True) == told  # peeking twice changes nothing
        assert p.speculate(8) == told             # and the step then decides exactly that
