"""When to speculate: compare the throughput each mode really delivers, per batch size.

Speculation pays at small batches (decode is memory-bound, verifying N tokens costs little more than one) and
stops paying as the batch grows, by an amount no model predicts well inside a server (prefills, the front end's
work and the host's share of a cycle all move with the load). So the policy measures tokens per second of wall
time per running sequence, over windows of `window` steps in one mode at one batch-size bucket (fed by
eyas.engine.adaptive_steps), as exponentially forgotten sums of tokens and seconds per bucket and mode; their ratio
weighs a stalled window by its length.

It runs the faster mode, switches only past a margin, and probes the slower one every `probe_every` windows
(4x less often when far behind) so that a change of traffic is noticed. A bucket with only speculation
measured borrows the verdict of the nearest larger bucket where speculation leads far (`_lead_above`); a
close call that plain decoding leads is unsettled until speculation has SETTLE windows there, since one
window's acceptance depends on its text.

Every second of busy time is booked exactly once, or the rates lie: a window cut short counts for its share
of steps, the draft's catch-up is speculation's, prefills are set apart (`set_aside`), a window with a graph
capture is void, idle time is nobody's (`close`), and where the next window `continues` the mode the decoder
does not wait for the GPU at the boundary. `seconds` and `tokens` total each book for benchmarks to check.
Warm-up runs both modes (`forced`) and books nothing. Both modes are lossless: no choice changes the output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field


BOOKS = ("speculative", "plain", "void", "prefill")  # where the policy books engine time
RECENT = 512  # closed windows kept for inspection (a window that stalled shows there with its catch-up time)
FAR = 0.8     # a mode at less than this times the other's rate is far behind: probed 4x less often
SETTLE = 4    # windows of steps the mode not chosen needs at a bucket before a close call there is settled


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
    prefill: float = 0.0   # seconds of prefills inside it, set aside
    catch_up: float = 0.0  # host seconds of the draft's catch-up passes inside it (charged to it: speculative)
    void: bool = False     # a CUDA graph was captured in it: booked as void, no rate
    seconds: float = 0.0   # booked when it closed


@dataclass
class SpecPolicy:
    max_batch: int | None = None   # fixed rule: never speculate above this (None = no fixed limit)
    adaptive: bool = False         # choose per bucket from measured rates
    window: int = 16               # steps per measurement window (one cut short counts for its share)
    probe_every: int = 16          # windows between tries of the mode not chosen
    alpha: float = 0.3             # share of the sums a full new window forgets
    margin: float = 0.05           # the other mode must be this much faster to be switched to
    forced: bool | None = None     # warm-up: run this mode whatever the rates say, measure nothing
    rates: dict = field(default_factory=dict)      # (bucket, speculated) -> tokens/s per sequence: sums[0] / sums[1]
    sums: dict = field(default_factory=dict)       # (bucket, speculated) -> (tokens per sequence, seconds), forgotten
    measured: dict = field(default_factory=dict)   # (bucket, speculated) -> steps of its windows booked so far
    windows: dict = field(default_factory=dict)    # bucket -> windows decided there
    preferred: dict = field(default_factory=dict)  # bucket -> the mode chosen there last
    seconds: dict = field(default_factory=lambda: dict.fromkeys(BOOKS, 0.0))  # charged per mode, void, prefill
    tokens: dict = field(default_factory=lambda: dict.fromkeys(BOOKS, 0))     # produced in those seconds
    current: Window | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # the last closed windows (windows_closed)

    def gain(self, batch_size: int) -> float | None:
        """Measured speculative rate over plain rate at this batch size (None: not both measured yet)."""
        b = bucket(batch_size)
        spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
        return None if spec is None or plain is None else spec / max(plain, 1e-9)

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
        mode, preferred = self._pick(b, self.rates, self.measured)
        if preferred is not None:  # both modes measured: a window decided by the rates
            self.windows[b] = self.windows.get(b, 0) + 1
            self.preferred[b] = preferred
        return mode

    def _pick(self, b: int, rates: dict, measured: dict) -> tuple[bool, bool | None]:
        """The mode of the next window at bucket b from these rates, and the mode preferred there (None
        until both modes are measured over a window's worth of steps: a window cut short after a step or two
        by a change of bucket, with a switch's wait in it, must not decide a bucket alone). Changes nothing."""
        if measured.get((b, True), 0) < self.window:
            return True, None   # measure speculation first ...
        n = self.windows.get(b, 0) + 1
        if measured.get((b, False), 0) < self.window:
            if self._lead_above(b, rates, measured):  # keep speculating; plain measured on the probe schedule
                return n % self.probe_every != 0, True
            return False, None  # ... then plain decoding
        g = rates[(b, True)] / max(rates[(b, False)], 1e-9)  # a window may read no tokens of its own (continues)
        current = self.preferred.get(b, g >= 1.0)
        if current and g < 1 / (1 + self.margin):
            current = False
        elif not current and g > 1 + self.margin:
            current = True
        # A far slower mode's probe windows are long: probed 4x less often, probes cost about the same share
        # of time whatever the ratio. Speculation's rate depends on the text, plain decoding's does not: while
        # plain leads a close call, speculation gets every second window until it has SETTLE windows' steps.
        far = g < FAR or g > 1 / FAR
        near = FAR ** 2 < g < 1 / FAR ** 2
        unsettled = near and not current and measured.get((b, True), 0) < SETTLE * self.window
        every = 2 if unsettled else self.probe_every * (4 if far else 1)
        return ((not current) if n % every == 0 else current), current

    def _lead_above(self, b: int, rates: dict, measured: dict) -> bool:
        """Whether speculation is far ahead (more than 1 / FAR) at the nearest larger bucket with both modes
        measured (2b, else 4b, ...): speculation's lead only grows as the batch shrinks."""
        top = max((key[0] for key in measured), default=0)
        c = 2 * b
        while c <= top:
            if min(measured.get((c, True), 0), measured.get((c, False), 0)) >= self.window:
                return rates[(c, True)] > rates[(c, False)] / FAR
            c *= 2
        return False

    def continues(self, batch_size: int, now: float) -> bool:
        """At a boundary (boundary() true): whether the window that the next step opens, once the open one
        is closed at `now`, runs the open one's mode at its bucket, so that the decoder need not wait for
        the GPU between them. Exactly the choice close() and speculate() will then make; changes nothing."""
        w = self.current
        if w is None or not self.adaptive or self.forced is not None or w.bucket != bucket(batch_size):
            return False
        if self.max_batch is not None and batch_size > self.max_batch:
            return not w.speculated
        rates, measured, closed = dict(self.rates), dict(self.measured), self._closed_sums(w, now)
        if closed is not None:
            key, (tokens, seconds) = closed
            rates[key], measured[key] = tokens / seconds, measured.get(key, 0) + w.steps
        return self._pick(w.bucket, rates, measured)[0] == w.speculated

    # -- measurements, fed by the decoder -----------------------------------------------------------
    def boundary(self, batch_size: int) -> bool:
        """Whether the next step at this batch size starts a new window (the decoder then closes the open
        window, and first waits for the GPU unless the next window `continues` its mode)."""
        return self.adaptive and self.forced is None and not self._in_window(batch_size)

    def close(self, now: float):
        """End the open window now and add it to its mode's sums (the old part forgotten by its steps)."""
        w, self.current = self.current, None
        if w is None:
            return
        closed = self._closed_sums(w, now)
        mode = "void" if closed is None else "speculative" if w.speculated else "plain"
        w.seconds = max(now - w.start - w.prefill, 0.0)
        self.recent.append(w)
        self.seconds[mode] += w.seconds
        self.tokens[mode] += w.tokens
        if closed is not None:
            key, self.sums[key] = closed
            self.rates[key] = self.sums[key][0] / self.sums[key][1]
            self.measured[key] = self.measured.get(key, 0) + w.steps

    def _closed_sums(self, w: Window, now: float) -> tuple | None:
        """(key, sums) of w's mode and bucket once w is closed at `now`; None for a void window."""
        seconds = now - w.start - w.prefill
        if w.void or seconds <= 0:
            return None
        # Per sequence: the two modes' windows may see somewhat different batch sizes within one bucket.
        key, per_sequence = (w.bucket, w.speculated), w.tokens / (w.sequences / w.steps)
        keep = 1 - self.alpha * min(1.0, w.steps / self.window)
        old_tokens, old_seconds = self.sums.get(key, (0.0, 0.0))
        return key, (keep * old_tokens + per_sequence, keep * old_seconds + seconds)

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

    def set_aside(self, seconds: float):
        """A prefill took these seconds (GPU settled before and after): the same work in either mode, as
        each request is prefilled once whichever mode runs, so it is booked apart and not charged to the
        open window, whose rate it would only make noisier. Forced (warm-up) prefills are not booked."""
        if self.forced is not None:
            return
        self.seconds["prefill"] += seconds
        if self.current is not None:
            self.current.prefill += seconds

    def caught_up(self, seconds: float):
        """The draft's catch-up before a speculative step took these host seconds (kept with its window)."""
        if self.current is not None:
            self.current.catch_up += seconds

    def step_done(self, tokens: int, captured_graph: bool = False):
        if self.current is not None:
            self.current.tokens += tokens
            self.current.void |= captured_graph

    def snapshot(self) -> dict:
        """What the policy believes now, for /metrics: {"rates": {(bucket, speculated): tokens/s per
        sequence}, "seconds" and "tokens": {mode or "void": charged so far}}."""
        return {"rates": dict(self.rates), "seconds": dict(self.seconds), "tokens": dict(self.tokens)}

    def windows_closed(self) -> list[dict]:
        """The last RECENT closed windows, oldest first, each as a dict of Window's fields."""
        return [asdict(w) for w in self.recent]
