"""The step loop of a speculative engine: per step, the policy's mode (a speculative cycle or a plain step),
the policy's windows fed with the steps' tokens and times, and the waits for the GPU that keep each window's
books its own: where the mode may change, around prefills, when the engine goes idle.

Owned by the SpeculativeDecoder (speculative.py), which hands it everything a step runs; the engine calls
`cycle`, `drain_ahead`, `prefill_started` / `prefill_done` and `idle`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from eyas.spec_policy import SpecPolicy

StepFn = Callable[[list], None]  # runs one step (or the catch-up) for these sequences


class AdaptiveSteps:
    def __init__(self, policy: SpecPolicy, spec_ahead, plain_ahead, *, speculative_cycle: StepFn, plain_step: StepFn,
                 catch_up: StepFn, agree: Callable[[bool], bool], captured_graphs: Callable[[], int],
                 device: torch.device):
        """`spec_ahead` and `plain_ahead` run cycles and plain steps ahead of the host (AheadOfHost); `agree`
        makes every tensor-parallel rank take rank 0's choice; `captured_graphs` counts the engine's CUDA
        graphs, so that a step which captured one is not booked."""
        self.policy = policy
        self.spec_ahead, self.plain_ahead = spec_ahead, plain_ahead
        self.speculative_cycle, self.plain_step, self.catch_up = speculative_cycle, plain_step, catch_up
        self.agree, self.captured_graphs, self.device = agree, captured_graphs, device
        self.last_decision = None  # (batch size, speculated) of the last step, for the server's metrics
        self.last_mode = None      # speculated or not, the last step

    def cycle(self, seqs):
        """One step for the running batch: a speculative cycle, or a plain step when the policy says so."""
        n, policy = len(seqs), self.policy
        self.last_decision = None  # until this step decides (a drain may end the batch first)
        settled = policy.boundary(n)
        if settled:
            now = time.perf_counter()
            if policy.continues(n, now):
                # The next window runs the same mode: no wait. Its first steps read the steps still in
                # flight, so it books as many steps' tokens as it has steps' time (spec_policy.py).
                policy.close(now)
                settled = False
        if settled:
            # A window of steps ends and the mode may change: read the cycles it still has in flight (their
            # tokens are its own), and wait for its last pass to finish, so that it is charged all of its
            # own GPU work and the next window none of it.
            self.drain_ahead()
            seqs = [s for s in seqs if not s.finished]
            if not seqs:  # the window's last cycles ended the batch: the engine releases it, then goes idle
                return
            n = len(seqs)
            self.settle()
            policy.close(time.perf_counter())
        speculate = policy.speculate(n)
        if policy.adaptive:  # decided from this rank's own measurements: every rank follows rank 0
            speculate = self.agree(speculate)
        self.last_decision = (n, speculate)
        if policy.adaptive:
            if speculate != self.last_mode and not settled:
                self.settle()  # the other mode's last pass may still be running: not this step's work
            policy.step_started(n, speculate, time.perf_counter())
        self.last_mode = speculate
        if (self.spec_ahead.active and not (speculate and self.spec_ahead.usable(seqs))) or \
                (speculate and self.plain_ahead.active):
            self.drain_ahead()  # the host's view of the batch (and the draft's lag) must be current first
            seqs = [s for s in seqs if not s.finished]
            if not seqs:
                return
        captured = self.captured_graphs() if policy.adaptive else 0
        lagging = [s for s in seqs if s.draft_state.lag_tokens] if speculate else []
        if lagging:  # inside the step, so charged to speculation, the mode that needs it (spec_policy.py)
            started = time.perf_counter()
            self.catch_up(lagging)
            policy.caught_up(time.perf_counter() - started)
        run = self.speculative_cycle if speculate else self.plain_step
        if not policy.adaptive:
            run(seqs)
            return
        before = sum(len(s.output_ids) for s in seqs)
        run(seqs)
        # A step that captured a CUDA graph took far longer than its kind does: its window says nothing.
        policy.step_done(sum(len(s.output_ids) for s in seqs) - before, self.captured_graphs() != captured)

    def drain_ahead(self):
        """Read every cycle or plain step still in flight ahead of the host (ahead.py); under the
        adaptive policy their tokens go to the open window, whose time they took."""
        for mode in (self.spec_ahead, self.plain_ahead):
            if mode.active:
                seqs = mode.seqs
                before = sum(len(s.output_ids) for s in seqs)
                mode.drain()
                self.policy.step_done(sum(len(s.output_ids) for s in seqs) - before)

    def prefill_started(self) -> float:
        """The engine is about to prefill joining requests: under the adaptive policy, wait for the GPU so
        that the prefill's time is its own (spec_policy.py books it apart from both modes)."""
        if self.policy.adaptive:
            self.settle()
        return time.perf_counter()

    def prefill_done(self, started: float):
        if self.policy.adaptive:
            self.settle()
            self.policy.set_aside(time.perf_counter() - started)

    def idle(self):
        """The engine ran out of work: end the policy's window now, so the wait for the next request is
        charged to neither mode."""
        if self.policy.adaptive and self.policy.current is not None:
            self.settle()
            self.policy.close(time.perf_counter())

    def settle(self):
        """Wait until the GPU has run everything queued so far (a no-op on the CPU, where work is synchronous)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
