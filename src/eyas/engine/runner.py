"""The runner owns the KV cache and runs forwards of the target model.

Eager forwards attend over the smallest 128-column bucket that holds the sequences; decode-shaped
forwards on CUDA can be replayed from CUDA graphs (see graphs.py), which attend over the whole row.

Prefills of a few short prompts, the joins of a loaded server, run as CUDA-graph replays too, in chunks of
PREFILL_CHUNK tokens each appended like a verify pass: a small model's eager prefill costs mostly host-side
launches, many times a graphed decode step (benchmarks/bench_join.py). Long prompts and large groups (batch jobs) stay
eager, where the GPU's own work hides the launches.
"""

from __future__ import annotations

import torch

from eyas.layers.kv_cache import KVCache
from eyas.layers.attention import AttentionBatch
from eyas.models.llama import ModelOutput

KV_BUCKET = 128
PREFILL_CHUNK = 64           # tokens per graphed prefill chunk: graphs.MAX_GRAPH_TOKENS, the longest graphed pass
GRAPHED_PREFILL_ROWS = 16    # prompts in one graphed prefill at most
GRAPHED_PREFILL_TOKENS = 256  # longest prompt prefilled in graphed chunks (4 replays)


def chunked_length(T: int) -> int:
    """Columns a T-token prefill in PREFILL_CHUNK-token chunks writes: T rounded up to whole chunks."""
    return -(-T // PREFILL_CHUNK) * PREFILL_CHUNK


class ModelRunner:
    def __init__(self, model, num_slots: int, max_len: int, device):
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        self.max_len = max_len
        kv_heads, head_dim, shared = cfg.kv_cache_layout(model.tp.size)
        dtype = next(model.parameters()).dtype
        # One extra row that no sequence owns: CUDA-graph padding rows write there.
        self.kv = KVCache(cfg.num_layers, num_slots + 1, max_len, kv_heads, head_dim, dtype, self.device, shared)
        self.scratch_slot = self.kv.allocate_scratch()
        self.graphs = None  # graphs.CudaGraphs, set by the Engine on CUDA
        self.persistent = None  # persistent.PersistentTarget, set by the Engine
        self.chunked_prefill: bool | None = None  # None: when graphs can replay the chunks; True/False: always/never

    def kv_len_for(self, starts: list[int], num_new: int) -> int:
        need = max(starts) + num_new
        return min(self.max_len, -(-need // KV_BUCKET) * KV_BUCKET)

    def prefill(self, input_ids: torch.Tensor, slots: list[int]) -> ModelOutput:
        """input_ids: [B, T] prompts right-padded to the longest, written from column 0 of each slot.
        Padding sits after every real token, so no real token attends to it; the columns it writes lie
        past each sequence's length, where later forwards overwrite them."""
        B, T = input_ids.shape
        if not self.prefills_in_chunks(B, T):
            positions = torch.arange(T, device=self.device)[None].expand(B, T)
            return self.forward(input_ids, positions, slots, [0] * B, graph=False)
        C = PREFILL_CHUNK
        ids = torch.nn.functional.pad(input_ids, (0, chunked_length(T) - T))
        hidden, aux = [], []
        for start in range(0, T, C):
            positions = torch.arange(start, start + C, device=self.device)[None].expand(B, C)
            out = self.forward(ids[:, start:start + C], positions, slots, [start] * B)
            hidden.append(out.hidden.clone())  # a graph's outputs live only until its next replay
            if out.aux_hidden is not None:
                aux.append(out.aux_hidden.clone())
        return ModelOutput(torch.cat(hidden, 1)[:, :T], torch.cat(aux, 1)[:, :T] if aux else None)

    def prefills_in_chunks(self, B: int, T: int) -> bool:
        """Whether a prefill of B prompts padded to T tokens runs in graphed chunks (the draft's follows)."""
        if chunked_length(T) > self.max_len:
            return False
        if self.chunked_prefill is not None:
            return self.chunked_prefill
        return (self.graphs is not None and B <= GRAPHED_PREFILL_ROWS and T <= GRAPHED_PREFILL_TOKENS
                and self.graphs.can_run(B, PREFILL_CHUNK))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: list[int], starts: list[int],
                new_mask: torch.Tensor | None = None, graph: bool = True) -> ModelOutput:
        """input_ids, positions: [B, T] on the device; new tokens are written at starts[b] + [0, T).
        `graph=False` keeps a forward eager (prefills: their many shapes would each need a graph)."""
        B, T = input_ids.shape
        if graph and self.graphs is not None and self.graphs.can_run(B, T):
            return self.graphs.forward(input_ids, positions, slots, starts, new_mask)
        batch = AttentionBatch(
            kv=self.kv,
            slots=torch.tensor(slots, device=self.device),
            starts=torch.tensor(starts, device=self.device),
            kv_len=self.kv_len_for(starts, T),
            new_mask=new_mask,
        )
        return self.model(input_ids, positions, batch)
