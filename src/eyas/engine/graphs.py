"""CUDA graphs for decode-shaped target forwards (plain decode, chain and tree verify).

One graph per (batch bucket, new tokens, tree mask or not, KV-length bucket), captured lazily on
first use into one shared memory pool. Inputs are copied into static buffers; rows past the real
batch are padded to point at a scratch cache slot, so padding never touches a live sequence.
An eager run and a graph run give identical tokens (tests/engine/test_graphs.py on CUDA).
"""

from __future__ import annotations

import torch

from eyas.kernels.graph_capture import CAPTURE_ATTEMPTS, capture  # noqa: F401 (CAPTURE_ATTEMPTS: tests)
from eyas.layers.attention import AttentionBatch, kernel_reads_cache
from eyas.models.llama import ModelOutput

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPH_TOKENS = 64


def kv_bucket(need: int, max_len: int) -> int:
    b = 256
    while b < need:
        b *= 2
    return min(b, max_len)


def graph_kv_len(kv, need: int) -> int:
    """Cache columns a forward attends over. The torch attention pays for every column, so its graphs
    come in doubling buckets. The slot-attention kernel reads each row over its own length, so with it
    only two bounds matter: up to SHORT_ROWS columns (up to 4 splits) and the whole row (up to 16); a
    growing context then captures at most one new graph per shape."""
    if kernel_reads_cache(kv):
        return kernel_kv_len(need, kv.max_len)
    return kv_bucket(need, kv.max_len)


def kernel_kv_len(need: int, max_len: int) -> int:
    """graph_kv_len over the slot-attention kernel: SHORT_ROWS columns for short rows, else the whole row."""
    return min(SHORT_ROWS, max_len) if need <= SHORT_ROWS else max_len


SHORT_ROWS = 512  # the bound of attention_splits.choose_splits' short rows


class _Graph:
    def __init__(self, runner, B, T, tree, kv_len, pool):
        dev = runner.device
        self.B, self.T = B, T
        self.ids = torch.zeros((B, T), dtype=torch.long, device=dev)
        self.pos = torch.zeros((B, T), dtype=torch.long, device=dev)
        self.slots = torch.full((B,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.starts = torch.zeros((B,), dtype=torch.long, device=dev)
        self.mask = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T).clone() if tree else None
        self.batch = AttentionBatch(kv=runner.kv, slots=self.slots, starts=self.starts, kv_len=kv_len, new_mask=self.mask)
        self.graph, self.out = capture(lambda: runner.model(self.ids, self.pos, self.batch), pool)

    def run(self, ids, pos, slots, starts, new_mask, scratch):
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.pos[:n].copy_(pos)
        self.slots.fill_(scratch)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.starts.zero_()
        self.starts[:n].copy_(starts, non_blocking=True)
        if self.mask is not None:
            self.mask[:n].copy_(new_mask)
        self.graph.replay()
        aux = self.out.aux_hidden[:n] if self.out.aux_hidden is not None else None
        return ModelOutput(self.out.hidden[:n], aux)


class CudaGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}
        self.functions = FunctionGraphs(self.pool)
        self.max_batch = max(b for b in BATCH_BUCKETS if b <= max(runner.kv.num_slots, 1)) if runner.kv.num_slots else 0

    def can_run(self, B: int, T: int) -> bool:
        return T <= MAX_GRAPH_TOKENS and B <= self.max_batch  # max_batch is itself a bucket

    def run(self, ids, pos, slots: list[int], starts: list[int], new_mask):
        B, T = ids.shape
        bucket = next(b for b in BATCH_BUCKETS if b >= B)
        kv_len = graph_kv_len(self.runner.kv, max(starts) + T)
        key = (bucket, T, new_mask is not None, kv_len)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(self.runner, bucket, T, new_mask is not None, kv_len, self.pool)
        slots_t, starts_t = torch.tensor([slots, starts], dtype=torch.long, device=self.runner.device)  # one copy
        return g.run(ids, pos, slots_t, starts_t, new_mask, self.runner.scratch_slot)


def enable_cuda_graphs(engine):
    engine.runner.graphs = CudaGraphs(engine.runner)


class FunctionGraphs:
    """CUDA graphs of arbitrary tensor functions (the draft phases), keyed by the caller.

    The caller pads inputs to a fixed shape; inputs are copied into static buffers and outputs are
    the graph's static tensors. Every graph shares the engine's memory pool, so a graph captured later
    may keep its outputs where an earlier-captured graph keeps temporaries: outputs are valid until the
    next replay of the same key *or of any other graph*. Copy what must outlive another replay.
    """

    def __init__(self, pool):
        self.pool = pool
        self.graphs = {}

    def run(self, key, fn, inputs):
        entry = self.graphs.get(key)
        if entry is None:
            static = [x.clone() for x in inputs]
            graph, outs = capture(lambda: fn(*static), self.pool)
            entry = self.graphs[key] = (graph, static, outs)
        graph, static, outs = entry
        for buf, x in zip(static, inputs):
            buf.copy_(x)
        graph.replay()
        return outs
