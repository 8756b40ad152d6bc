"""Greedy speculative cycles one ahead of the host: the GPU runs cycle k while the host reads cycle k-1's tokens.

A greedy cycle (speculative.py) already runs on the device from its inputs to its results: the draft, the
verify pass and the commit graph (acceptance and the draft's extend pass), then one read of the accepted
tokens. Everything the next cycle needs is on the device by then: its root token (the bonus token), its
cache length (c + accepted + 1) and the draft's state (the commit graph's outputs). So the next cycle can be
enqueued before that read, from device tensors, and the host reads cycle k-1's tokens from pinned memory
while cycle k runs: the host's work per cycle (three graph launches, input copies, the token bookkeeping)
then hides behind the GPU's instead of adding to it.

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
it off, with plain decoding ahead (decode_ahead.py). On an H200 it took SmolLM2's chain 4/1/5 from 1,427 to
1,680 tok/s and the tree 5/4/8 from 1,229 to 1,402, the same tokens (docs/BENCHMARKS.md, 2026-12-01).
"""

from __future__ import annotations

import torch

from eyas.engine.decode_ahead import may_run_ahead
from eyas.engine.draft_state import gather_states, set_states
from eyas.engine.flights import AheadOfHost
from eyas.engine.graphs import BATCH_BUCKETS


class SpecAhead(AheadOfHost):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec  # the SpeculativeDecoder
        # the next cycle's inputs, on the device, padded to the batch bucket
        self.root = self.c_t = self.slots_t = self.active_rows = self.hidden = self.logp = None

    def usable(self, seqs) -> bool:
        """Whether this cycle of `seqs` may run here: the batch this mode holds, or one it may start on."""
        spec = self.spec
        if not spec.accept_on_device or not may_run_ahead(spec.engine, seqs):
            return False
        if any(s.draft_state.lag_tokens for s in seqs):
            return False
        return self.holds(seqs) if self.active else True

    def _start(self, seqs):
        spec = self.spec
        dev, B = spec.engine.device, len(seqs)
        Bp = next(b for b in BATCH_BUCKETS if b >= B)
        pad = Bp - B
        hidden, logp = gather_states(seqs)
        rows = torch.tensor([[s.output_ids[-1] for s in seqs] + [0] * pad, [s.cached for s in seqs] + [0] * pad,
                             [s.slot for s in seqs] + [spec.engine.runner.scratch_slot] * pad,
                             [1] * B + [0] * pad], device=dev)  # one host-to-device copy
        self.root, self.c_t, self.slots_t, self.active_rows = rows[0], rows[1], rows[2], rows[3]
        self.hidden = torch.cat([hidden, hidden.new_zeros((pad,) + hidden.shape[1:])]) if pad else hidden
        self.logp = torch.cat([logp, logp.new_zeros((pad,) + logp.shape[1:])]) if pad else logp
        self.seqs = list(seqs)
        self._enqueue()

    def _may_enqueue(self) -> bool:
        """Even if every cycle in flight accepts all it drafted, no sequence reaches max_tokens before the
        cycle to enqueue: the normal path would run it too, and its cache writes stay in the reserved space."""
        longest = len(self.flights) * (self.spec.spec.steps + 1)
        return all(len(s.output_ids) + longest < s.params.max_tokens for s in self.seqs)

    def _enqueue(self):
        spec = self.spec
        B, c_t, slots_t = len(self.seqs), self.c_t, self.slots_t
        c = max(s.cached for s in self.seqs) + len(self.flights) * (spec.spec.steps + 1)  # the longest case
        tokens, parents, depth, mask = spec._draft(B, c, self.logp, self.hidden, self.root, c_t, slots_t)
        argmax, _, aux = spec._verify(B, c, tokens, depth, mask, c_t, slots_t, padded=True)
        new, accepted, h, logp = spec._commit(B, c, tokens, parents, depth, argmax, aux, c_t, slots_t, padded=True)
        # The next cycle's inputs, computed on the device (copies: the graphs' outputs are overwritten
        # by their next replay).
        self.hidden, self.logp = h.clone(), logp.clone()
        self.root = new.gather(1, accepted[:, None])[:, 0]
        self.c_t = c_t + (accepted + 1) * self.active_rows  # padding rows stay at column 0 of the scratch row
        self.flights.send(torch.cat([new, accepted[:, None]], dim=1))

    def _consume(self):
        rows = self.flights.pop().read(len(self.seqs))
        live = [(s, row) for s, row in zip(self.seqs, rows) if not s.finished]  # a stop learned a cycle late
        self.spec._advance([s for s, _ in live], [row[:row[-1] + 1] for _, row in live], [row[-1] for _, row in live])

    def drain(self):
        """Read every cycle in flight, give each sequence its draft state back and leave this mode."""
        if not self.active:
            return
        while self.flights:
            self._consume()
        B = len(self.seqs)
        set_states(self.seqs, self.hidden[:B], self.logp[:B])
        self.seqs = None
        self.root = self.c_t = self.slots_t = self.active_rows = self.hidden = self.logp = None
