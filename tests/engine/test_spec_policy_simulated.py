"""The adaptive policy under serving-like conditions, on a simulated clock: step costs known to the
simulation (not to the policy), noisy step times, a noisy acceptance length, joins whose prefills land
between steps, and a catch-up pass whenever speculation follows plain steps. The policy is driven as the
decoder drives it (speculative.py): a window boundary closes the open window at the current time, each
step starts, its catch-up (if any) runs inside it, each step reports its tokens, prefills are set aside.
It must end within a few percent of the better mode, run the better mode most of the time, and follow a
change of traffic."""

import random

import pytest

from eyas.spec_policy import SpecPolicy


def simulate(n, plain_s, cycle_s, accept, churn, mode=None, steps=8000, catch_up_s=0.4e-3, prefill_s=3e-3,
             accept_later=None, seed=0, burst_tokens=None, burst_s=0.0, opening=(0, None), known=None):
    """tokens/s over the run and the share of speculative steps; `mode` fixes the mode (the reference runs);
    `accept_later` changes the acceptance halfway through; `opening` = (tokens, acceptance): the acceptance
    until that many tokens per sequence are out (a response's opening lines); every `burst_tokens` tokens a
    burst of joins stalls the engine for `burst_s` (a server admitting a batch of requests at once); `known`:
    {(bucket, speculated): tokens/s per sequence} the policy measured before (at other batch sizes)."""
    rng = random.Random(seed)
    policy = SpecPolicy(adaptive=mode is None)
    for key, rate in (known or {}).items():
        policy.rates[key], policy.measured[key] = rate, policy.window
    clock = tokens = since_burst = 0.0
    lagging, speculated, late = False, 0, 0
    for i in range(steps):
        if policy.boundary(n):
            policy.close(clock)
        spec = policy.speculate(n) if mode is None else mode
        policy.step_started(n, spec, clock)
        if spec and lagging:
            clock += catch_up_s
            lagging = False
        clock += (cycle_s if spec else plain_s) * rng.uniform(0.85, 1.15)
        mean = accept if accept_later is None or i < steps // 2 else accept_later
        mean = opening[1] if tokens < n * opening[0] else mean
        got = round(n * min(4.0, max(1.0, rng.gauss(mean, 0.4)))) if spec else n
        policy.step_done(got)
        tokens += got
        speculated += spec
        late += spec and i >= steps * 3 // 4
        lagging |= not spec
        # Joins' prefills between two steps (as many per token in either mode), booked apart as the
        # engine books them: one now and then, and bursts of them.
        stall = prefill_s if rng.random() < churn * got / n else 0.0
        since_burst += got
        if burst_tokens and since_burst >= burst_tokens:
            stall += burst_s
            since_burst -= burst_tokens
        clock += stall
        policy.set_aside(stall)
    return tokens / clock, speculated / steps, late / (steps - steps * 3 // 4)


# batch, plain step s, speculative cycle s, acceptance: shaped like the H200 measurements of SmolLM2
# (speculation pays 1.4x at batch 1 and 4, loses 0.86x at 16 and 0.7x at 64).
CASES = [(1, 1.3e-3, 1.7e-3, 1.8), (4, 2.0e-3, 2.6e-3, 1.8), (16, 2.7e-3, 5.6e-3, 1.8), (64, 5.5e-3, 14.5e-3, 1.85)]


@pytest.mark.parametrize("n,plain_s,cycle_s,accept", CASES, ids=[f"batch{c[0]}" for c in CASES])
@pytest.mark.parametrize("churn", [0.0, 0.3])
def test_adaptive_policy_ends_near_the_better_mode(n, plain_s, cycle_s, accept, churn):
    rate, share, _ = simulate(n, plain_s, cycle_s, accept, churn)
    plain = simulate(n, plain_s, cycle_s, accept, churn, mode=False)[0]
    spec = simulate(n, plain_s, cycle_s, accept, churn, mode=True)[0]
    assert rate >= 0.97 * max(plain, spec)
    assert (share > 0.85) if spec > plain else (share < 0.15)  # the rest: the first windows and the probes


def test_adaptive_policy_follows_a_change_of_traffic():
    """Batch 4, acceptance 1.8 (speculation 1.4x) falling to 1.0 halfway (0.85x with the noise clamped at 1):
    plain by the last quarter."""
    _, _, late = simulate(4, 2.0e-3, 2.6e-3, 1.8, 0.1, accept_later=1.0)
    assert late < 0.15


# A server admits joining requests in bursts, and a burst's prefills stall the engine for longer than a
# window (150-300 ms every 20-40 tokens per sequence). Speculation here is 0.87-0.93x or 1.11-1.22x of
# plain decoding before the stalls, which bring it closer still (0.94-0.98x, 1.03-1.08x).
BURSTS = [(16, 2.7e-3, 5.6e-3, 1.8), (16, 2.7e-3, 4.0e-3, 1.8), (64, 5.5e-3, 8e-3, 1.3), (64, 5.5e-3, 8e-3, 1.6)]


@pytest.mark.parametrize("n,plain_s,cycle_s,accept", BURSTS, ids=[f"batch{c[0]}-cycle{c[2] * 1e3:g}ms-acc{c[3]}" for c in BURSTS])
@pytest.mark.parametrize("every,stall", [(40, 0.15), (20, 0.3)])
def test_bursts_of_prefills_do_not_blur_a_close_choice(n, plain_s, cycle_s, accept, every, stall):
    bursts = dict(burst_tokens=n * every, burst_s=stall)
    rate, share, _ = simulate(n, plain_s, cycle_s, accept, 0.0, **bursts)
    plain = simulate(n, plain_s, cycle_s, accept, 0.0, mode=False, **bursts)[0]
    spec = simulate(n, plain_s, cycle_s, accept, 0.0, mode=True, **bursts)[0]
    assert rate >= 0.98 * max(plain, spec)
    assert (share > 0.85) if spec > plain else (share < 0.15)


@pytest.mark.parametrize("seed", range(4))
def test_a_hard_opening_does_not_decide_a_short_response(seed):
    """Batch 1, one response of about 256 tokens whose first 30 accept 1.4 and the rest 2.2 (speculation
    1.08-1.17x of plain over the whole response, about 0.75x over its first window): the policy must not
    decode the rest plain on the strength of that window (on an H200 it then ran at 0.86x of always
    speculating; here, without the close call measured again soon, at 0.83-0.87x, below plain)."""
    kw = dict(n=1, plain_s=0.6e-3, cycle_s=1.1e-3, accept=2.2, churn=0.0, catch_up_s=0.3e-3, seed=seed,
              opening=(30, 1.4), steps=160)
    rate = simulate(**kw)[0]
    spec, plain = simulate(**kw, mode=True)[0], simulate(**kw, mode=False)[0]
    assert spec > 1.05 * plain and rate >= 0.9 * spec and rate > plain


def test_a_smaller_batch_lead_does_not_decide_a_short_run_at_a_larger_one():
    """Speculation led plain by 1.66x per sequence at bucket 32, and a batch of 64 then runs for 20 windows,
    where plain decoding is 1.12x faster. The policy measures plain at 64 instead of borrowing bucket 32's lead
    (a policy that borrowed it would speculate the whole run and never measure plain)."""
    kw = dict(n=64, plain_s=5.5e-3, cycle_s=8e-3, accept=1.3, churn=0.0, steps=320,
              known={(32, True): 1660.0, (32, False): 1000.0})
    rate, share, _ = simulate(**kw)
    plain = simulate(**kw, mode=False)[0]
    spec = simulate(**kw, mode=True)[0]
    assert plain > 1.05 * spec
    assert rate >= 0.95 * plain and share < 0.3


@pytest.mark.parametrize("seed", range(3))
def test_a_clear_lead_of_speculation_is_not_measured_again_and_again(seed):
    """A batch's tail: 2 sequences for 12 windows, where speculation leads plain by about 1.4x per sequence.
    Plain decoding's rate does not depend on the text, so once measured it is probed on the slow schedule; a
    policy that gave it every second window until it had SETTLE windows would run 3 plain windows more here."""
    kw = dict(n=2, plain_s=1.0e-3, cycle_s=1.5e-3, accept=2.1, churn=0.0, steps=192, seed=seed)
    rate, share, _ = simulate(**kw)
    spec = simulate(**kw, mode=True)[0]
    assert spec > 1.3 * simulate(**kw, mode=False)[0]
    assert share >= 10 / 12 and rate >= 0.93 * spec
