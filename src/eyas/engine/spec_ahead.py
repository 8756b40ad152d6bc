"""Greedy speculative cycles one ahead of the host: the GPU runs cycle k while the host reads cycle k-1's tokens.

A greedy cycle (speculative.py) already runs on the device from its inputs to its results: the draft, the
verify pass and the commit graph (acceptance and the draft's extend pass), then one read of the accepted
tokens. Everything the next cycle needs is on the device by then: its root token (the bonus token), its
cache length (c + accepted + 1) and the draft's state (the commit graph's outputs). So the next cycle can be
enqueued before that read, from device tensors, and the host reads cycle k-1's tokens from pinned memory
while cycle k runs: the host's work per cycle then hides behind the GPU's instead of adding to it. Here a whole
cycle is one CUDA graph, two per batch bucket and attention bound replayed in turn (_CyclePair, as
decode_ahead.py's plain steps), so a cycle costs the GPU no copies of inputs into graph buffers and no launch
gaps between phases; EYAS_CYCLE_GRAPH=0 runs the three phase graphs instead (a bench switch).

The host knows a sequence's length only up to the last cycle it read, so a cycle in flight may have added
up to steps + 1 tokens: graph bounds are chosen for the longest case, and a cycle is enqueued only while
even the longest outcome of those in flight leaves the sequence short of max_tokens (its cache writes then
stay inside what admission reserved). A stop is learned a cycle late: the cycle already enqueued is read
for the other sequences and dropped for the stopped one (it wrote past that sequence's end only). Before
anything else touches the batch (an admission, an abort, a plain step, a sampled request) the engine
drains: it reads every cycle in flight and hands each sequence its draft state back.

Runs for batches of greedy sequences on one GPU, with CUDA graphs, without a profiler (it times each phase).
Under the adaptive policy (spec_policy.py) the speculative windows run ahead too: a window's end drains its
cycles into its books and waits for the GPU, one wait per window; its plain windows run ahead through
decode_ahead.py, which keeps each step's features for the draft's lag. On by default; EYAS_DECODE_AHEAD=0 turns
it off, with plain decoding ahead (decode_ahead.py). The same tokens, 11-18% faster for SmolLM2's chains and
trees (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from eyas.engine import graphs as cuda_graphs
from eyas.engine.decode_ahead import may_run_ahead
from eyas.engine.draft_state import gather_states, set_states
from eyas.engine.flights import AheadOfHost
from eyas.engine.graphs import BATCH_BUCKETS, graph_kv_len
from eyas.options import off


def cycle_graph_on() -> bool:
    """One CUDA graph per cycle (the default), or the draft, verify and commit graphs in turn (EYAS_CYCLE_GRAPH=0)."""
    return not off("EYAS_CYCLE_GRAPH")


@dataclass
class _State:
    """What a cycle reads, per row of the batch bucket: the root token, the cache length and the draft's output."""
    root: torch.Tensor    # [bucket]
    c_t: torch.Tensor     # [bucket]
    hidden: torch.Tensor  # [bucket, H]
    scores: torch.Tensor  # [bucket, draft vocab]

    def copy_(self, other: "_State"):
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))


class _CyclePair:
    """Two CUDA graphs of a whole cycle (draft, verify, acceptance, the draft's extend pass, a tree's KV
    compaction) for one (bucket, attention bounds): graph i reads state[i] and writes state[1 - i], so replayed
    in turn they speculate with no input from the host, and each body is idempotent (its capture runs it three
    times): the verify pass rewrites every cache column that the compaction then moves. Against a graph per
    phase this saves the copies of each phase's inputs into its graph's buffers and two graph launches per cycle."""

    def __init__(self, decoder, bucket: int, kv_draft: int, kv_target: int, hidden: torch.Tensor, scores: torch.Tensor,
                 pool):
        dev = hidden.device
        scratch = decoder.engine.runner.scratch_slot

        def state():
            return _State(torch.zeros(bucket, dtype=torch.long, device=dev), torch.zeros(bucket, dtype=torch.long,
                                                                                          device=dev),
                          hidden.new_zeros((bucket,) + hidden.shape[1:]),
                          scores.new_zeros((bucket,) + scores.shape[1:]))

        self.state = (state(), state())
        self.slots = torch.full((bucket,), scratch, dtype=torch.long, device=dev)  # padding rows: the scratch slot
        self.active = torch.zeros(bucket, dtype=torch.long, device=dev)  # 1 for the batch's rows

        def body(src: _State, dst: _State):
            tokens, parents, depth, mask = decoder.draft_fn(src.scores, src.hidden, src.root, src.c_t, self.slots,
                                                            kv_draft)
            argmax, _, aux = decoder.verify_body(tokens, depth, mask, src.c_t, self.slots, kv_target)
            new, accepted, sel, h, scores_next = decoder.commit_body(tokens, parents, depth, argmax, aux, src.c_t,
                                                                     self.slots, kv_draft)
            decoder.compact_paths(self.slots, src.c_t, sel, accepted)
            dst.hidden.copy_(h)
            dst.scores.copy_(scores_next)
            dst.root.copy_(new.gather(1, accepted[:, None])[:, 0])
            dst.c_t.copy_(src.c_t + (accepted + 1) * self.active)  # padding rows stay at column 0 of the scratch row
            return torch.cat([new, accepted[:, None]], dim=1)

        captured = [cuda_graphs.capture(lambda i=i: body(self.state[i], self.state[1 - i]), pool) for i in (0, 1)]
        self.graphs = [graph for graph, _ in captured]
        self.results = [out for _, out in captured]  # each graph's [bucket, steps + 2]: new tokens, accepted count
        self.next = 0  # the state the next replay reads

    @property
    def current(self) -> _State:
        return self.state[self.next]

    def seed(self, state: _State, slots: torch.Tensor, active: torch.Tensor):
        """The next cycle's inputs (device tensors, bucket rows)."""
        self.next = 0
        self.state[0].copy_(state)
        self.slots.copy_(slots)
        self.active.copy_(active)

    def replay(self) -> torch.Tensor:
        """Run the next cycle; returns its results, valid until the next replay of any graph."""
        results = self.results[self.next]
        self.graphs[self.next].replay()
        self.next = 1 - self.next
        return results


class SpecAhead(AheadOfHost):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder  # the SpeculativeDecoder whose cycles run here
        self.whole_cycles = cycle_graph_on()  # read once: an engine keeps its mode (benchmarks build both)
        self.pairs: dict[tuple, _CyclePair] = {}
        self.pair: _CyclePair | None = None
        # the next cycle's inputs without whole-cycle graphs, on the device, padded to the batch bucket
        self._root = self._c_t = self.slots_t = self._active = self.hidden = self.scores = None

    @property
    def c_t(self) -> torch.Tensor:
        """The next cycle's cache length per bucket row."""
        return self.pair.current.c_t if self.pair is not None else self._c_t

    @property
    def active_rows(self) -> torch.Tensor:
        """1 for the batch's rows, 0 for padding."""
        return self.pair.active if self.pair is not None else self._active

    def usable(self, seqs) -> bool:
        """Whether this cycle of `seqs` may run here: the batch this mode holds, or one it may start on."""
        decoder = self.decoder
        if not decoder.accept_on_device or not may_run_ahead(decoder.engine, seqs):
            return False
        if any(s.draft_state.lag_tokens for s in seqs):
            return False
        return self.holds(seqs) if self.active else True

    def _pair_for(self, bucket: int, c: int, hidden: torch.Tensor, scores: torch.Tensor) -> _CyclePair:
        """The pair of whole-cycle graphs for `bucket` rows whose longest holds at most c cached tokens. One
        attention bound for the cycle's passes (its largest need), so that a row crossing a bound never needs
        a pair of mixed bounds, which the warm-up would not have captured."""
        decoder = self.decoder
        need = c + max(decoder.reach.values())
        key = (bucket, graph_kv_len(decoder.kv, need), graph_kv_len(decoder.engine.runner.kv, need))
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = _CyclePair(decoder, bucket, key[1], key[2], hidden, scores,
                                                decoder.engine.runner.graphs.pool)
        return pair

    def _start(self, seqs):
        decoder = self.decoder
        dev, B = decoder.engine.device, len(seqs)
        Bp = next(b for b in BATCH_BUCKETS if b >= B)
        pad = Bp - B
        hidden, scores = gather_states(seqs)
        rows = torch.tensor([[s.output_ids[-1] for s in seqs] + [0] * pad, [s.cached for s in seqs] + [0] * pad,
                             [s.slot for s in seqs] + [decoder.engine.runner.scratch_slot] * pad,
                             [1] * B + [0] * pad], device=dev)  # one host-to-device copy
        root, c_t, slots_t, active = rows[0], rows[1], rows[2], rows[3]
        hidden = torch.cat([hidden, hidden.new_zeros((pad,) + hidden.shape[1:])]) if pad else hidden
        scores = torch.cat([scores, scores.new_zeros((pad,) + scores.shape[1:])]) if pad else scores
        self.seqs = list(seqs)
        if self.whole_cycles:
            self.pair = self._pair_for(Bp, max(s.cached for s in seqs), hidden, scores)
            self.pair.seed(_State(root, c_t, hidden, scores), slots_t, active)
        else:
            self._root, self._c_t, self.slots_t, self._active, self.hidden, self.scores = \
                root, c_t, slots_t, active, hidden, scores
        self._enqueue()

    def _may_enqueue(self) -> bool:
        """Even if every cycle in flight accepts all it drafted, no sequence reaches max_tokens before the
        cycle to enqueue: the normal path would run it too, and its cache writes stay in the reserved space."""
        longest = self._in_flight()
        return all(len(s.output_ids) + longest < s.params.max_tokens for s in self.seqs)

    def _in_flight(self) -> int:
        """The most tokens the cycles in flight may add to a row: each may accept all it drafted."""
        return len(self.flights) * (self.decoder.spec.steps + 1)

    def _longest(self) -> int:
        """The most cached tokens a row may hold when the cycle to enqueue runs."""
        return max(s.cached for s in self.seqs) + self._in_flight()

    def _enqueue(self):
        if self.whole_cycles:
            self._enqueue_whole()
            return
        decoder = self.decoder
        B, c_t, slots_t = len(self.seqs), self._c_t, self.slots_t
        c = self._longest()
        tokens, parents, depth, mask = decoder.draft_pass(B, c, self.scores, self.hidden, self._root, c_t, slots_t)
        argmax, _, aux = decoder.verify_pass(B, c, tokens, depth, mask, c_t, slots_t, padded=True)
        new, accepted, h, scores = decoder.commit_pass(B, c, tokens, parents, depth, argmax, aux, c_t, slots_t,
                                                       padded=True)
        # The next cycle's inputs, computed on the device (copies: the graphs' outputs are overwritten
        # by their next replay).
        self.hidden, self.scores = h.clone(), scores.clone()
        self._root = new.gather(1, accepted[:, None])[:, 0]
        self._c_t = c_t + (accepted + 1) * self._active  # padding rows stay at column 0 of the scratch row
        self.flights.send(torch.cat([new, accepted[:, None]], dim=1))

    def _enqueue_whole(self):
        """The next cycle as one graph replay; a row that may cross an attention bound moves the state to the
        pair of the wider bound first, on the device."""
        old = self.pair
        pair = self._pair_for(len(old.slots), self._longest(), old.current.hidden, old.current.scores)
        if pair is not old:
            pair.seed(old.current, old.slots, old.active)
            self.pair = pair
        self.flights.send(pair.replay())

    def _consume(self):
        rows = self.flights.pop().read(len(self.seqs))
        live = [(s, row) for s, row in zip(self.seqs, rows) if not s.finished]  # a stop learned a cycle late
        self.decoder.advance([s for s, _ in live], [row[:row[-1] + 1] for _, row in live], [row[-1] for _, row in live])

    def drain(self):
        """Read every cycle in flight, give each sequence its draft state back and leave this mode."""
        if not self.active:
            return
        while self.flights:
            self._consume()
        B = len(self.seqs)
        if self.pair is not None:  # copies: the pair's buffers are the next batch's inputs
            state = self.pair.current
            set_states(self.seqs, state.hidden[:B].clone(), state.scores[:B].clone())
        else:
            set_states(self.seqs, self.hidden[:B], self.scores[:B])
        self.seqs = self.pair = None
        self._root = self._c_t = self.slots_t = self._active = self.hidden = self.scores = None
