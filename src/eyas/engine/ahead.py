"""Greedy steps one ahead of the host: the GPU runs step k while the host reads step k-1's tokens.

When a greedy step ends, everything the next one reads is already on the device: its token (the argmax, or a
cycle's bonus token), its cache length and, for a speculative cycle, the draft's output. So a step is captured
as a pair of CUDA graphs (GraphPair) that each read one set of inputs and write the next step's into the other:
replayed in turn they run step after step with no input from the host. The host enqueues step k and then reads
step k-1's result, copied into pinned memory, while step k runs (Flights): its work per step hides behind the
GPU's, and no step pays for copies of inputs into graph buffers. Two modes run so: DecodeAhead, plain greedy
steps (a speculative engine's plain steps too, whose target features it keeps for the draft's lag,
catch_up.py), and SpecAhead, whole speculative cycles (speculative.py's greedy_cycle, the body its in-step
cycles run too).

The host knows a row's length only up to the last step it read, so a step in flight may have added up to
`tokens_per_step` tokens: graph bounds are chosen for the longest case, and a step is enqueued only while even
the longest outcome of those in flight leaves every sequence short of max_tokens (its cache writes then stay
inside what admission reserved). A stop is learned a step late: the step already enqueued is read for the
other sequences and dropped for the stopped one (it wrote past that sequence's end only). Before anything else
touches the batch (an admission, an abort, a sampled request, the other mode) the engine drains: it reads every
step in flight and leaves the mode. execution_plan's decode_ahead=False turns both modes off (docs/kernels.md
has the gains).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from eyas import execution_plan
from eyas.engine import graphs as cuda_graphs
from eyas.engine.catch_up import hold_back
from eyas.engine.draft_state import gather_states, set_states
from eyas.engine.graphs import bucket_rows, graph_kv_len
from eyas.layers.attention import AttentionBatch


def may_run_ahead(engine, seqs) -> bool:
    """What both modes need: the switch on, CUDA graphs for the batch, one GPU, no profiler (it times each
    phase), and only greedy sequences (no generator to draw from) that want no log-probabilities (the host
    reads no logits)."""
    graphs = engine.runner.graphs
    if (not execution_plan.current().decode_ahead or graphs is None or engine.profiler is not None
            or engine.target.tp.size != 1):
        return False
    return len(seqs) <= graphs.max_batch and all(s.params.greedy and s.generator is None and not s.wants_logprobs
                                                 for s in seqs)


@dataclass
class StepInputs:
    """What a greedy step reads per row of its batch (padded to a bucket where graphs replay it), on the device."""
    token: torch.Tensor                 # [rows] the last token (a cycle's root)
    cached: torch.Tensor                # [rows] the cache length
    slots: torch.Tensor                 # [rows] the cache row; padding rows at the scratch slot
    active: torch.Tensor                # [rows] 1 for the batch's rows, 0 for padding
    hidden: torch.Tensor | None = None  # [rows, H] a cycle's draft output at the last position
    scores: torch.Tensor | None = None  # [rows, draft vocab] its scores (Drafter.scores)

    def copy_(self, other: StepInputs):
        """Copy `other` in, field by field (a field both share is left alone)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None and mine is not theirs:
                mine.copy_(theirs)

    def blank(self, scratch: int) -> StepInputs:
        """Zeros of the same shapes, every row at the scratch slot: what a graph's capture may run on."""
        new = {f.name: None if getattr(self, f.name) is None else torch.zeros_like(getattr(self, f.name))
               for f in fields(self)}
        new["slots"].fill_(scratch)
        return StepInputs(**new)


def step_inputs(seqs, rows: int, scratch: int, device, with_draft: bool) -> StepInputs:
    """The batch's next step inputs from the host, padded to `rows` (one host-to-device copy), and with
    `with_draft` the draft states of a speculative cycle."""
    B, pad = len(seqs), rows - len(seqs)
    host = torch.tensor([[s.output_ids[-1] for s in seqs] + [0] * pad, [s.cached for s in seqs] + [0] * pad,
                         [s.slot for s in seqs] + [scratch] * pad, [1] * B + [0] * pad], device=device)
    x = StepInputs(host[0], host[1], host[2], host[3])
    if with_draft:
        x.hidden, x.scores = (torch.cat([t, t.new_zeros((pad,) + t.shape[1:])]) if pad else t
                              for t in gather_states(seqs))
    return x


class GraphPair:
    """Two CUDA graphs of one step, `body(inputs) -> (outputs, next inputs)`: graph i reads inputs[i] and writes
    the next step's into inputs[1 - i]. Both sets share `slots` and `active`, which stay for a batch. A body
    must be pure or idempotent: its capture runs it three times."""

    def __init__(self, body, blank: StepInputs, pool):
        self.inputs = (blank, replace(blank.blank(0), slots=blank.slots, active=blank.active))  # rows shared

        def step(i: int):
            outputs, following = body(self.inputs[i])
            self.inputs[1 - i].copy_(following)
            return outputs

        captured = [cuda_graphs.capture(lambda i=i: step(i), pool) for i in (0, 1)]
        self.graphs = [graph for graph, _ in captured]
        self.outputs = [outputs for _, outputs in captured]  # each graph's own, valid until its next replay
        self.next = 0  # the graph whose inputs hold the next step

    @property
    def current(self) -> StepInputs:
        return self.inputs[self.next]

    def seed(self, inputs: StepInputs):
        """The next step's inputs (device tensors, bucket rows)."""
        self.next = 0
        self.inputs[0].copy_(inputs)

    def replay(self):
        """Run the next step; returns its outputs."""
        outputs = self.outputs[self.next]
        self.graphs[self.next].replay()
        self.next = 1 - self.next
        return outputs


class Flight:
    """One enqueued step's result, copied to host memory, ready once `event` has passed, and what the mode
    keeps of it on the device (`kept`) until it is read."""

    def __init__(self, result: torch.Tensor, host: torch.Tensor, kept):
        self.host, self.kept = host, kept
        self.event = None
        if result.is_cuda:
            self.host.copy_(result, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host.copy_(result)

    def read(self, n: int) -> list:
        """The first n rows, as lists (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[:n].tolist()


class Flights:
    """The steps in flight, oldest first. At most two are in flight at once, so a ring of three host buffers per
    result shape never hands out one that is not yet read."""

    RING = 3

    def __init__(self):
        self._queue: list[Flight] = []
        self._buffers: dict[tuple, list[torch.Tensor]] = {}  # per (shape, dtype): a ring of host buffers
        self.sent = 0  # results sent so far

    def send(self, result: torch.Tensor, kept=None) -> None:
        """Start copying `result` (a device tensor the next step may overwrite) to the host."""
        key = (tuple(result.shape), result.dtype)
        ring = self._buffers.get(key)
        if ring is None:
            ring = self._buffers[key] = [torch.empty(result.shape, dtype=result.dtype, pin_memory=result.is_cuda)
                                         for _ in range(self.RING)]
        self.sent += 1
        self._queue.append(Flight(result, ring[self.sent % self.RING], kept))

    def pop(self) -> Flight:
        """The oldest step in flight, no longer counted as in flight."""
        return self._queue.pop(0)

    def __len__(self) -> int:
        return len(self._queue)


class AheadOfHost:
    """A mode ahead of the host: the batch it holds while steps are in flight, its graph pairs, and the loop that
    keeps one step ahead. A subclass says what its step is: `_body` (GraphPair's), `_kv_lens` (its attention
    bounds), `tokens_per_step` (the most a step adds to a row), `reach` (cache columns past the longest row
    that a step writes), `_take` (a read step into the sequences) and `_leave` (what a drain hands back)."""

    with_draft = False  # whether a step reads the draft's state
    tokens_per_step = 1
    reach = 1
    keeps_finished = False  # whether a finished row stays in the batch, stopped on the device (DecodeAhead's doc)

    def __init__(self, engine):
        self.engine = engine
        self.seqs: list | None = None  # the batch while this mode runs, in row order
        self.flights = Flights()
        self.pairs: dict[tuple, GraphPair] = {}  # (bucket, attention bounds...) -> its pair
        self.pair: GraphPair | None = None
        self.stopped: set[int] = set()  # rows of finished sequences kept in the batch (keeps_finished)

    @property
    def active(self) -> bool:
        return self.seqs is not None

    def holds(self, seqs) -> bool:
        """Whether `seqs` is the batch this mode holds, the same sequences in the same rows (less the finished
        rows it keeps)."""
        rows = self._live() if self.keeps_finished else self.seqs
        return len(seqs) == len(rows) and all(a is b for a, b in zip(seqs, rows))

    def _live(self) -> list:
        return [s for s in self.seqs if not s.finished]

    def usable(self, seqs) -> bool:
        """Whether this step of `seqs` may run here: the batch this mode holds, or one it may start on."""
        if not may_run_ahead(self.engine, seqs):
            return False
        return self.holds(seqs) if self.active else True

    def advance(self, seqs):
        """Enqueue the next step (unless it may not run: a sequence about to reach max_tokens), then read the
        oldest step in flight into the sequences; drain when the batch must change (_must_leave)."""
        if not self.active:
            self._start(seqs)
        if self.keeps_finished:
            self._stop_rows()
        if self._may_enqueue():
            self._enqueue()
        self._consume()
        if not self.flights or self._must_leave():
            self.drain()

    def _must_leave(self) -> bool:
        """After a read: whether the batch must change. A mode that keeps finished rows (stopped on the device
        before the next step is enqueued) leaves only once none is live or the live ones fit a smaller bucket."""
        if not self.keeps_finished:
            return any(s.finished for s in self.seqs)
        live = len(self._live())
        return not live or bucket_rows(live) < self.pair.current.token.shape[0]

    def _stop_rows(self):
        """Before a step is enqueued: zero the `active` flag of finished rows, and of rows the steps in flight
        bring to max_tokens (each adds one token), behind those steps: their cache length stops there and later
        steps rewrite that column."""
        for i, s in enumerate(self.seqs):
            if i in self.stopped:
                continue
            if s.finished or self._may_reach_max_tokens(s):
                self.pair.current.active[i] = 0  # shared by both input sets; a fill on the stream, no copy to wait on
                self.stopped.add(i)

    def drain(self):
        """Read every step in flight and leave this mode (the batch may change after)."""
        if not self.active:
            return
        while self.flights:
            self._consume()
        self._leave()
        self.seqs = self.pair = None

    def _start(self, seqs):
        runner = self.engine.runner
        rows = bucket_rows(len(seqs))
        inputs = step_inputs(seqs, rows, runner.scratch_slot, self.engine.device, self.with_draft)
        self.seqs = list(seqs)
        self.stopped = set()
        self.pair = self._pair_for(inputs)
        self.pair.seed(inputs)
        self._enqueue()

    def _longest(self) -> int:
        """The most cached tokens a row may hold when the step to enqueue runs."""
        return max(s.cached for s in self.seqs) + len(self.flights) * self.tokens_per_step

    def _may_enqueue(self) -> bool:
        """Even if every step in flight adds all it may, no sequence reaches max_tokens before the step to
        enqueue: the in-step path would run it too, and its cache writes stay in the reserved space."""
        return not any(self._may_reach_max_tokens(s)
                       for i, s in enumerate(self.seqs) if not s.finished and i not in self.stopped)

    def _may_reach_max_tokens(self, s) -> bool:
        """Whether the steps in flight, each adding all it may, could bring `s` to its max_tokens."""
        return len(s.output_ids) + len(self.flights) * self.tokens_per_step >= s.params.max_tokens

    def _pair_for(self, like: StepInputs) -> GraphPair:
        """The pair for inputs like `like` whose attention bounds cover the longest row. One bound for all of a
        step's passes (its largest need), so that a row crossing a bound never needs a pair of mixed bounds,
        which the warm-up would not have captured."""
        runner = self.engine.runner
        key = (like.token.shape[0],) + self._kv_lens(self._longest() + self.reach)
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = GraphPair(self._body(*key[1:]), like.blank(runner.scratch_slot),
                                               runner.graphs.pool)
        return pair

    def _enqueue(self):
        """The next step as one graph replay; a row that may cross an attention bound moves the inputs to the
        pair of the wider bound first, on the device."""
        old = self.pair
        pair = self._pair_for(old.current)
        if pair is not old:
            pair.seed(old.current)
            self.pair = pair
        outputs = pair.replay()
        result, kept = outputs if isinstance(outputs, tuple) else (outputs, None)
        self.flights.send(result, None if kept is None else kept.clone())  # the next replay overwrites it

    def _consume(self):
        flight = self.flights.pop()
        rows = flight.read(len(self.seqs))
        live = [i for i, s in enumerate(self.seqs) if not s.finished]  # a stop learned a step late: dropped
        self._take([self.seqs[i] for i in live], [rows[i] for i in live], flight.kept, live)

    def _leave(self):
        pass


class DecodeAhead(AheadOfHost):
    """Plain greedy steps: the forward, the LM head and the argmax, whose token is the next step's input.

    A finished row stays in the batch until the live rows fit a smaller bucket or the batch changes: its `active`
    flag is zeroed behind the steps in flight, so later steps keep rewriting one cache column of its own slot
    (one that admission reserved) and never move its length. A row that the steps in flight bring to max_tokens
    is stopped so before it is read, so that it holds no step back. A large batch whose rows finish on nearly
    every step (regen's) would otherwise leave this mode on nearly every step."""

    keeps_finished = True

    def _kv_lens(self, need: int) -> tuple[int]:
        return (graph_kv_len(self.engine.runner.kv, need),)

    def _body(self, kv_len: int):
        runner, target = self.engine.runner, self.engine.target

        def step(x: StepInputs):
            if runner.persistent is not None and runner.persistent.serves(x.token.shape[0], 1, kv_len):
                tokens, _, aux = runner.persistent.forward(x.token[:, None], x.cached, x.slots)
                tokens = tokens[:, -1]
            else:
                batch = AttentionBatch(kv=runner.kv, slots=x.slots, starts=x.cached, kv_len=kv_len)
                out = runner.model(x.token[:, None], x.cached[:, None], batch)
                tokens, aux = target.logits(out.hidden[:, -1]).argmax(-1), out.aux_hidden
            following = StepInputs(tokens, x.cached + x.active, x.slots, x.active)
            # A target that feeds a draft also returns the step's features (the draft's lag, catch_up.py).
            return (tokens if aux is None else (tokens, aux[:, -1])), following
        return step

    def _take(self, seqs, tokens, features, rows):
        self.engine.take_step(seqs, tokens)
        if features is not None:  # a speculative engine's plain step: the draft catches up on it later
            hold_back(seqs, features, rows)


class SpecAhead(AheadOfHost):
    """Greedy speculative cycles, each one replay of speculative.py's greedy_cycle; a drain hands each sequence
    its draft state back."""

    with_draft = True

    def __init__(self, decoder):
        super().__init__(decoder.engine)
        self.decoder = decoder  # the SpeculativeDecoder whose cycles run here
        self.tokens_per_step = decoder.spec.steps + 1
        self.reach = max(decoder.reach.values())

    def usable(self, seqs) -> bool:
        """Also: acceptance on the device, and no sequence holding plain steps back from the draft."""
        if not self.decoder.accept_on_device or not super().usable(seqs):
            return False
        return not any(s.draft_state.lag_tokens for s in seqs)

    def _kv_lens(self, need: int) -> tuple[int, int]:
        return graph_kv_len(self.decoder.kv, need), graph_kv_len(self.engine.runner.kv, need)

    def _body(self, kv_draft: int, kv_target: int):
        kv_lens = {"tree": kv_draft, "verify": kv_target, "commit": kv_draft}

        def run(name, fn, inputs):
            return fn(*inputs, kv_lens[name])
        return lambda x: self.decoder.greedy_cycle(x, run)

    def _take(self, seqs, rows, kept, live):
        self.decoder.advance(seqs, [row[:row[-1] + 1] for row in rows], [row[-1] for row in rows])

    def _leave(self):
        B, inputs = len(self.seqs), self.pair.current  # copies: the pair's buffers are the next batch's inputs
        set_states(self.seqs, inputs.hidden[:B].clone(), inputs.scores[:B].clone())
