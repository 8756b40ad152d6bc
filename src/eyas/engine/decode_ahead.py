"""Plain greedy decoding one step ahead of the host: the GPU runs step k while the host reads step k-1's tokens.

At batch 1 a small model's decode graph replays in about two thirds of a token's time end to end: the rest is
host work between graphs (inputs copied in, the LM head and the argmax launched, the token read back) while
the GPU idles. Here each batch bucket has two CUDA graphs that run
the forward, the LM head and the argmax, and write the next step's inputs (the argmax as the next token, the
positions and cache lengths one further) into the other graph's input buffers: replayed in turn they decode
with no host input at all. The host enqueues step k and then reads step k-1's tokens, copied into pinned
memory, while step k runs. Each graph reads one buffer set and writes the other, so its body is idempotent.

It runs while nothing changes the batch: every sequence greedy, one GPU, no profiler. With a draft (the plain
steps that the speculation policy chooses, speculative.py) each step's graph also returns the target's
features of the step, copied on the device as the step is enqueued and handed to the draft's lag as its token
is read. A stop (EOS, a stop token) is learned one step late: the step already enqueued is then read for the
other sequences and dropped for the stopped one (its cache write lies past that sequence's end). A step is
never enqueued past a sequence's max_tokens. Before anything else touches the batch (an admission, an abort, a sampled request, a
longer attention bound) the engine drains: it reads the steps in flight and leaves this mode.
On by default (execution_plan's decode_ahead=False turns it off, and spec_ahead.py's twin with it); the same tokens, 24-34%
faster on SmolLM2 (docs/kernels.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from eyas.engine import graphs as cuda_graphs
from eyas.engine.catch_up import hold_back
from eyas.engine.flights import AheadOfHost
from eyas.engine.graphs import BATCH_BUCKETS, graph_kv_len
from eyas.layers.attention import AttentionBatch
from eyas import execution_plan


def decode_ahead_on() -> bool:
    return execution_plan.current().decode_ahead


def may_run_ahead(engine, seqs) -> bool:
    """What both modes ahead of the host (this one and spec_ahead.py) need: the switch on, CUDA graphs for the
    batch, one GPU, no profiler (it times each step), and only greedy sequences (no generator to draw from) that want
    no log-probabilities (the host reads no logits there)."""
    graphs = engine.runner.graphs
    if not decode_ahead_on() or graphs is None or engine.profiler is not None or engine.target.tp.size != 1:
        return False
    return len(seqs) <= graphs.max_batch and all(s.params.greedy and s.generator is None and not s.wants_logprobs
                                                 for s in seqs)


@dataclass
class _Inputs:
    """One buffer set of a graph pair: what a decode step reads."""
    ids: torch.Tensor     # [bucket, 1]
    pos: torch.Tensor     # [bucket, 1]
    slots: torch.Tensor   # [bucket]
    starts: torch.Tensor  # [bucket]


class _Pair:
    """Two graphs for one (bucket, kv_len): graph i reads inputs[i] and writes inputs[1 - i] and `tokens`."""

    def __init__(self, runner, target, bucket: int, kv_len: int, pool):
        dev = runner.device

        def buffers():
            return _Inputs(torch.zeros((bucket, 1), dtype=torch.long, device=dev),
                           torch.zeros((bucket, 1), dtype=torch.long, device=dev),
                           torch.full((bucket,), runner.scratch_slot, dtype=torch.long, device=dev),
                           torch.zeros((bucket,), dtype=torch.long, device=dev))

        self.inputs = (buffers(), buffers())
        self.active = torch.zeros((bucket, 1), dtype=torch.long, device=dev)  # 1 for the batch's rows
        self.tokens = torch.zeros((bucket,), dtype=torch.long, device=dev)

        def body(src: _Inputs, dst: _Inputs):
            batch = AttentionBatch(kv=runner.kv, slots=src.slots, starts=src.starts, kv_len=kv_len)
            out = runner.model(src.ids, src.pos, batch)
            tokens = target.logits(out.hidden[:, -1]).argmax(-1)
            self.tokens.copy_(tokens)
            dst.ids.copy_(tokens[:, None])
            dst.pos.copy_(src.pos + self.active)
            dst.starts.copy_(src.starts + self.active[:, 0])
            dst.slots.copy_(src.slots)
            # A target that feeds a draft also returns the step's features (the draft's lag, speculative.py).
            return self.tokens if out.aux_hidden is None else (self.tokens, out.aux_hidden[:, -1])

        captured = [cuda_graphs.capture(lambda i=i: body(self.inputs[i], self.inputs[1 - i]), pool) for i in (0, 1)]
        self.graphs = [graph for graph, _ in captured]
        # Each graph's own output buffer of the features (None without a draft), valid until the next replay.
        self.features = [outs[1] if isinstance(outs, tuple) else None for _, outs in captured]
        self.next = 0  # the graph whose inputs hold the next step

    def seed(self, seqs, scratch_slot: int):
        """The first step's inputs from the host: each sequence's last token at its cache length."""
        n = len(seqs)
        src = self.inputs[0]
        rows = torch.tensor([[s.output_ids[-1] for s in seqs], [s.cached for s in seqs], [s.slot for s in seqs]],
                            dtype=torch.long)
        src.ids.zero_()
        src.pos.zero_()
        src.starts.zero_()
        src.slots.fill_(scratch_slot)
        src.ids[:n, 0].copy_(rows[0])
        src.pos[:n, 0].copy_(rows[1])
        src.starts[:n].copy_(rows[1])
        src.slots[:n].copy_(rows[2])
        self.active.zero_()
        self.active[:n] = 1
        self.next = 0

    def replay(self) -> torch.Tensor | None:
        """Run the next step; returns its features [bucket, 3H] (None without a draft), valid until a replay."""
        features = self.features[self.next]
        self.graphs[self.next].replay()
        self.next = 1 - self.next
        return features


class DecodeAhead(AheadOfHost):
    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.pairs: dict[tuple[int, int], _Pair] = {}
        self.pair: _Pair | None = None
        self.features: deque = deque()  # per step in flight, with a draft: a copy of its features, else None
        self._pair_key: tuple[int, int] | None = None

    def usable(self, seqs) -> bool:
        """Whether this step of `seqs` may run here: the batch this mode holds, or one it may start on."""
        if not may_run_ahead(self.engine, seqs):
            return False
        if self.active:
            return self.holds(seqs) and self._key(seqs, ahead=len(self.flights)) == self._pair_key
        return True

    def _key(self, seqs, ahead: int) -> tuple[int, int]:
        bucket = next(b for b in BATCH_BUCKETS if b >= len(seqs))
        need = max(s.cached for s in seqs) + ahead + 1
        return bucket, graph_kv_len(self.engine.runner.kv, need)

    def _start(self, seqs):
        runner = self.engine.runner
        key = self._key(seqs, ahead=0)
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = _Pair(runner, self.engine.target, key[0], key[1], runner.graphs.pool)
        pair.seed(seqs, runner.scratch_slot)
        self.seqs, self.pair, self._pair_key = list(seqs), pair, key
        self._enqueue()

    def _may_enqueue(self) -> bool:
        """One more step stays within every sequence's max_tokens and within the captured attention bound."""
        ahead = len(self.flights)
        if any(len(s.output_ids) + ahead + 1 > s.params.max_tokens for s in self.seqs):
            return False
        return self._key(self.seqs, ahead=ahead) == self._pair_key

    def _enqueue(self):
        features = self.pair.replay()
        self.flights.send(self.pair.tokens)
        self.features.append(None if features is None else features.clone())  # the next replay overwrites it

    def _consume(self):
        tokens, features = self.flights.pop().read(len(self.seqs)), self.features.popleft()
        took = [i for i, s in enumerate(self.seqs) if not s.finished]  # a stop learned a step late: dropped
        self.engine.take_step(self.seqs, tokens)
        if features is not None:  # a speculative engine's plain step: the draft catches up on it later
            hold_back([self.seqs[i] for i in took], features, took)

    def drain(self):
        """Read every step in flight and leave this mode (the batch may change after)."""
        while self.flights:
            self._consume()
        self.seqs = self.pair = None
