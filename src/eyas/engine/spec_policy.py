"""When to speculate: measured, per batch size.

Speculation pays at small batches (decode is memory-bound, verifying N tokens costs little more than one)
and stops paying as the batch grows. Where that happens depends on the model, the draft's acceptance and
the hardware, so the adaptive policy measures it while serving: for each batch-size bucket it keeps a
moving average of tokens per second for speculative cycles and for plain steps, takes the better one, and
tries the other one now and then (less often when it is far behind) so that a change (new traffic, another
prompt mix) is noticed. It switches only when the other mode is faster by a margin: every switch back to
speculation costs a catch-up pass of the draft. Both modes are lossless and the draft catches up on the
plain steps before it drafts again, so switching never changes the output. Steps that captured a CUDA
graph are not recorded (speculative.py): a capture costs far more than the step, and counting it would
make the first mode tried in each bucket look slow.
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
    adaptive: bool = False         # choose per bucket from measured throughput
    explore_every: int = 32        # steps in a bucket between tries of the mode not preferred
    alpha: float = 0.2             # weight of the newest measurement in the moving average
    margin: float = 0.05           # the other mode must be this much faster to take over (no flapping on noise)
    rates: dict = field(default_factory=dict)   # (bucket, speculated) -> tokens/s moving average
    steps: dict = field(default_factory=dict)   # bucket -> steps decided there
    preferred: dict = field(default_factory=dict)  # bucket -> the mode currently preferred there

    def speculate(self, batch_size: int, peek: bool = False) -> bool:
        """The decision for the next step at this batch size; `peek` tells it without counting the step
        (the speculative decoder asks ahead of time whether the next step will speculate)."""
        if self.max_batch is not None and batch_size > self.max_batch:
            return False
        if not self.adaptive:
            return True
        b = bucket(batch_size)
        n = self.steps.get(b, 0) + 1
        if not peek:
            self.steps[b] = n
        spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
        if spec is None or plain is None:
            return spec is None  # measure speculation first, then plain decoding
        current = self.preferred.get(b, spec >= plain)
        mine, other = (spec, plain) if current else (plain, spec)
        if other > mine * (1 + self.margin):
            current = not current
        if not peek:
            self.preferred[b] = current
        # A mode far behind is retried less often: each retry of it costs a step at its (slow) rate.
        every = self.explore_every * (8 if (plain if current else spec) < 0.7 * (spec if current else plain) else 1)
        return (not current) if n % every == 0 else current

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float):
        if not self.adaptive or seconds <= 0:
            return
        key = (bucket(batch_size), speculated)
        rate = tokens / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
