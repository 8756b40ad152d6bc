"""When to speculate: a cost model per batch size, fed by measurements.

Speculation pays at small batches (decode is memory-bound, verifying N tokens costs little more than one)
and stops paying as the batch grows. The adaptive policy predicts both modes' throughput at the batch
size of the next step from two things it keeps apart, because they change for different reasons:
- step costs, per batch-size bucket: seconds per plain step and per speculative cycle (hardware and
  batch size), each step timed from its start to the next step's start over the same batch
  (speculative.py). The engine's warm-up measures both modes at every bucket before traffic arrives
  (`forced`), and serving keeps refining them;
- the acceptance length, one moving average over all speculative cycles (the draft and the traffic).
Speculating is predicted faster when acceptance x plain step > cycle x (1 + margin); the margin keeps
the choice from flapping on noise (every switch back to speculation costs a catch-up pass of the draft).
While it decodes plainly, a speculative cycle now and then (`probe_every` steps, 8x less often when
speculation is far behind) keeps the acceptance estimate current; while it speculates, a plain step
now and then keeps the plain cost current. Both modes are lossless and the draft catches up on plain
steps before it drafts again, so no choice ever changes the output. Steps that captured a CUDA graph are
not recorded (speculative.py): a capture costs far more than the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


@dataclass
class SpecPolicy:
    max_batch: int | None = None   # fixed rule: never speculate above this (None = no fixed limit)
    adaptive: bool = False         # choose per bucket from the cost model
    probe_every: int = 64          # steps between tries of the mode not chosen
    alpha: float = 0.2             # weight of the newest measurement in the moving averages
    margin: float = 0.05           # speculation must be predicted this much faster to be chosen, and vice versa
    forced: bool | None = None     # warm-up: run this mode whatever the model says (still measured)
    costs: dict = field(default_factory=dict)      # (bucket, speculated) -> seconds per step, moving average
    accept: float | None = None                    # tokens per sequence per speculative cycle, moving average
    accept_cycles: int = 0                         # speculative cycles behind that average
    min_accept_cycles: int = 8                     # speculate at least this many cycles before judging the draft
    steps: dict = field(default_factory=dict)      # bucket -> steps decided there
    preferred: dict = field(default_factory=dict)  # bucket -> the mode chosen there last

    def gain(self, batch_size: int) -> float | None:
        """Predicted speculative throughput over plain throughput at this batch size (None: not known yet)."""
        b = bucket(batch_size)
        spec, plain = self.costs.get((b, True)), self.costs.get((b, False))
        if spec is None or plain is None or self.accept is None:
            return None
        return self.accept * plain / spec

    def speculate(self, batch_size: int) -> bool:
        """The decision for the next step at this batch size."""
        if self.max_batch is not None and batch_size > self.max_batch:
            return False
        if self.forced is not None:
            return self.forced
        if not self.adaptive:
            return True
        b = bucket(batch_size)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if (b, True) not in self.costs or self.accept_cycles < self.min_accept_cycles:
            return True   # measure speculation first (cost, and acceptance over several cycles: one says little) ...
        if (b, False) not in self.costs:
            return False  # ... then plain decoding
        g = self.gain(batch_size)
        current = self.preferred.get(b, g >= 1.0)
        if current and g < 1 / (1 + self.margin):
            current = False
        elif not current and g > 1 + self.margin:
            current = True
        self.preferred[b] = current
        # The mode not chosen is tried now and then; much less often when it is far behind, since each
        # try costs a step at its (slow) rate.
        far = g < 0.7 or g > 1 / 0.7
        every = self.probe_every * (8 if far else 1)
        return (not current) if n % every == 0 else current

    def snapshot(self) -> dict:
        """What the policy believes now, for /metrics: {"accept": tokens per cycle or None,
        "costs": {(bucket, speculated): seconds per step}}."""
        return {"accept": self.accept, "costs": dict(self.costs)}

    def record(self, batch_size: int, speculated: bool, seconds: float, accept: float | None = None):
        """One step: its wall time (0 = not timed), and for a speculative cycle its tokens per sequence."""
        if not self.adaptive:
            return
        if seconds > 0:
            key = (bucket(batch_size), speculated)
            old = self.costs.get(key)
            self.costs[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        if accept is not None and self.forced is None:  # warm-up's dummy prompts say nothing about acceptance
            self.accept_cycles += 1
            # The first cycles' plain mean, then the moving average (one unlucky first cycle must not decide).
            w = max(self.alpha, 1 / self.accept_cycles)
            self.accept = accept if self.accept is None else (1 - w) * self.accept + w * accept
