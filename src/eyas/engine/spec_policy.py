"""When to speculate: compare the throughput each mode really delivers, per batch size.

Speculation pays at small batches (decode is memory-bound, verifying N tokens costs little more than one)
and stops paying as the batch grows, by an amount no model predicts well inside a server: prefills of
joining requests, the front end's per-step work and the host's share of a cycle all move with the load.
So the adaptive policy measures the one thing that decides: tokens produced per second of wall time per
running sequence, over windows of `window` consecutive steps in one mode at one batch-size bucket, every
gap between the steps included (speculative.py feeds it). Per bucket it keeps a moving average of each
mode's rate and runs the faster one; the slower one gets one window now and then (`probe_every` windows,
4x less often when it is far behind) so that a change of traffic is noticed. A margin keeps the choice
from flapping on noise. Both modes are lossless and the draft catches up before it drafts again, so no
choice ever changes the output.

Every second of the engine's busy time belongs to exactly one window, or the rates lie. The version
measured first dropped windows cut short by a change of batch bucket and left the draft's catch-up pass
at a switch to nobody; under load on an H200 its beliefs read 3-4x the throughput its server delivered.
Now a window cut short counts with a weight in proportion to its steps, the catch-up is speculation's
cost (it exists only to speculate; charging it biases the choice toward plain decoding, the safe side),
and only a window with a CUDA-graph capture (a one-time cost that says nothing about its mode) is left
out, its seconds kept apart as "void". `seconds` totals what each mode was charged, so a benchmark can
check the books against the wall time. When the engine runs out of requests the decoder closes the window
(`close`), so idle time is nobody's. The engine's warm-up runs both modes on dummy prompts (`forced`);
those runs teach nothing, since a rate depends on the real acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field


MODES = ("speculative", "plain", "void")


def bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


@dataclass
class Window:
    bucket: int
    speculated: bool
    start: float           # wall time at the start of its first step
    steps: int = 1
    sequences: int = 0     # batch sizes of its steps, summed
    tokens: int = 0        # tokens its steps produced, summed over the batch
    void: bool = False     # a CUDA graph was captured in it: drop it


@dataclass
class SpecPolicy:
    max_batch: int | None = None   # fixed rule: never speculate above this (None = no fixed limit)
    adaptive: bool = False         # choose per bucket from measured rates
    window: int = 16               # steps per measurement window (one cut short counts for its share)
    probe_every: int = 16          # windows between tries of the mode not chosen
    alpha: float = 0.3             # weight of the newest window in the moving averages
    margin: float = 0.05           # the other mode must be this much faster to be switched to
    forced: bool | None = None     # warm-up: run this mode whatever the rates say, measure nothing
    rates: dict = field(default_factory=dict)      # (bucket, speculated) -> tokens/s per sequence, moving average
    windows: dict = field(default_factory=dict)    # bucket -> windows decided there
    preferred: dict = field(default_factory=dict)  # bucket -> the mode chosen there last
    seconds: dict = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))  # charged per mode, and void
    current: Window | None = None

    def gain(self, batch_size: int) -> float | None:
        """Measured speculative rate over plain rate at this batch size (None: not both measured yet)."""
        b = bucket(batch_size)
        spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
        return None if spec is None or plain is None else spec / plain

    def speculate(self, batch_size: int) -> bool:
        """The mode of the next step at this batch size: the open window's, or a new window's choice."""
        if self.max_batch is not None and batch_size > self.max_batch:
            return False
        if self.forced is not None:
            return self.forced
        if not self.adaptive:
            return True
        if self._in_window(batch_size):
            return self.current.speculated
        return self._choose(bucket(batch_size))

    def _in_window(self, batch_size: int) -> bool:
        """Whether a step at this batch size continues the open window."""
        w = self.current
        return w is not None and w.bucket == bucket(batch_size) and w.steps < self.window

    def _choose(self, b: int) -> bool:
        if (b, True) not in self.rates:
            return True   # measure speculation first ...
        if (b, False) not in self.rates:
            return False  # ... then plain decoding
        n = self.windows[b] = self.windows.get(b, 0) + 1
        g = self.rates[(b, True)] / self.rates[(b, False)]
        current = self.preferred.get(b, g >= 1.0)
        if current and g < 1 / (1 + self.margin):
            current = False
        elif not current and g > 1 + self.margin:
            current = True
        self.preferred[b] = current
        # A probe window has as many steps as any other, and a far slower mode's steps are long: probe it
        # 4x less often, so that probes cost about 1-2% of the time whatever the ratio.
        far = g < 0.8 or g > 1 / 0.8
        every = self.probe_every * (4 if far else 1)
        return (not current) if n % every == 0 else current

    # -- measurements, fed by the decoder -----------------------------------------------------------
    def boundary(self, batch_size: int) -> bool:
        """Whether the next step at this batch size starts a new window (the decoder then waits for the
        GPU and closes the open window, so that each window holds exactly its own steps' work)."""
        return self.adaptive and self.forced is None and not self._in_window(batch_size)

    def close(self, now: float):
        """End the open window now and fold its rate into its mode's average, weighted by its steps."""
        w, self.current = self.current, None
        if w is None:
            return
        seconds = now - w.start
        if w.void or seconds <= 0:
            self.seconds["void"] += max(seconds, 0.0)
            return
        self.seconds["speculative" if w.speculated else "plain"] += seconds
        # Per sequence: the two modes' windows may see somewhat different batch sizes within one bucket.
        key, rate = (w.bucket, w.speculated), w.tokens / seconds / (w.sequences / w.steps)
        old = self.rates.get(key)
        weight = self.alpha * min(1.0, w.steps / self.window)
        self.rates[key] = rate if old is None else (1 - weight) * old + weight * rate

    def step_started(self, batch_size: int, speculated: bool, now: float):
        """A step of this mode starts now: it continues the open window, or opens one."""
        if not self.adaptive or self.forced is not None:
            self.current = None
            return
        b, w = bucket(batch_size), self.current
        if w is not None and (w.bucket != b or w.speculated != speculated):  # e.g. rank 0 chose otherwise
            self.close(now)
            w = None
        if w is None:
            self.current = Window(b, speculated, now, sequences=batch_size)
            return
        w.steps += 1
        w.sequences += batch_size

    def step_done(self, tokens: int, captured_graph: bool = False):
        if self.current is not None:
            self.current.tokens += tokens
            self.current.void |= captured_graph

    def snapshot(self) -> dict:
        """What the policy believes now, for /metrics: {"rates": {(bucket, speculated): tokens/s per
        sequence}, "seconds": {mode or "void": seconds charged so far}}."""
        return {"rates": dict(self.rates), "seconds": dict(self.seconds)}
