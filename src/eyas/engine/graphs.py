"""CUDA graphs of decode-shaped passes (plain decode, verify, the draft's passes), per batch bucket and
attention bound, and the bounds themselves. An eager run and a graph run give identical tokens
(tests/engine/test_graphs.py on CUDA).
"""

from __future__ import annotations

import torch

from eyas.kernels.graph_capture import capture
from eyas.layers.attention import AttentionBatch, kernel_reads_cache
from eyas.models.llama import ModelOutput

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPH_TOKENS = 64


def graph_kv_len(kv, need: int) -> int:
    """Cache columns a forward attends over. The torch attention pays for every column, so its graphs
    come in doubling buckets. The slot-attention kernel reads each row over its own length, so with it
    only two bounds matter: up to SHORT_ROWS columns (up to 4 splits) and the whole row (up to 16); a
    growing context then captures at most one new graph per shape."""
    if kernel_reads_cache(kv):
        return kernel_kv_len(need, kv.max_len)
    b = 256
    while b < need:
        b *= 2
    return min(b, kv.max_len)


def kernel_kv_len(need: int, max_len: int) -> int:
    """graph_kv_len over the slot-attention kernel: SHORT_ROWS columns for short rows, else the whole row."""
    return min(SHORT_ROWS, max_len) if need <= SHORT_ROWS else max_len


SHORT_ROWS = 512  # the bound of attention_splits.choose_splits' short rows


def bucket_rows(B: int) -> int:
    """The batch bucket that B rows are padded to (B itself past the largest)."""
    return next((b for b in BATCH_BUCKETS if b >= B), B)


class CudaGraphs:
    """CUDA graphs of tensor functions over inputs padded to a batch bucket, keyed by the caller and captured
    lazily into one shared memory pool: the target's decode-shaped forwards (forward) and the draft's passes
    (speculative.py's run_padded). Inputs are copied into static buffers, rows past the batch set to a pad
    (cache slots to the scratch slot, so padding never touches a live sequence); outputs are the graph's static
    tensors. A graph captured later may keep its outputs where an earlier-captured graph keeps temporaries:
    outputs are valid until the next replay of the same key *or of any other graph*. Copy what must outlive it.
    """

    def __init__(self, runner):
        self.runner = runner
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph, static inputs, outputs)
        self.max_batch = max(b for b in BATCH_BUCKETS if b <= max(runner.kv.num_slots, 1)) if runner.kv.num_slots else 0

    def can_run(self, B: int, T: int) -> bool:
        return T <= MAX_GRAPH_TOKENS and B <= self.max_batch  # max_batch is itself a bucket

    def run(self, key, fn, inputs, rows: int, pads=None):
        """fn(*inputs) replayed from the graph of `key`, inputs padded to `rows` with `pads` (None: padded
        already)."""
        pads = pads if pads is not None else [None] * len(inputs)
        entry = self.graphs.get(key)
        if entry is None:
            static = [torch.empty((rows,) + x.shape[1:], dtype=x.dtype, device=x.device) for x in inputs]
            for buf, x, pad in zip(static, inputs, pads):
                _copy_padded(buf, x, pad)
            graph, outs = capture(lambda: fn(*static), self.pool)
            entry = self.graphs[key] = (graph, static, outs)
        graph, static, outs = entry
        for buf, x, pad in zip(static, inputs, pads):
            _copy_padded(buf, x, pad)
        graph.replay()
        return outs

    def forward(self, ids, pos, slots: list[int], starts: list[int], new_mask):
        """The target over B rows of T new tokens (runner.forward)."""
        B, T = ids.shape
        runner = self.runner
        kv_len = graph_kv_len(runner.kv, max(starts) + T)
        slots_t, starts_t = torch.tensor([slots, starts], dtype=torch.long, device=runner.device)  # one copy
        inputs, pads = [ids, pos, slots_t, starts_t], [0, 0, runner.scratch_slot, 0]
        if new_mask is not None:
            inputs, pads = inputs + [new_mask], pads + [True]

        def forward(ids, pos, slots, starts, mask=None):
            return runner.model(ids, pos, AttentionBatch(kv=runner.kv, slots=slots, starts=starts, kv_len=kv_len,
                                                         new_mask=mask))
        rows = bucket_rows(B)
        out = self.run(("target", rows, T, new_mask is not None, kv_len), forward, inputs, rows, pads)
        return ModelOutput(out.hidden[:B], None if out.aux_hidden is None else out.aux_hidden[:B])


def _copy_padded(buf: torch.Tensor, x: torch.Tensor, pad):
    n = x.shape[0]
    buf[:n].copy_(x)
    if n < buf.shape[0]:
        buf[n:].fill_(pad)
