"""The runner owns the KV cache and runs forwards of the target model.

Eager forwards attend over the smallest 128-column bucket that holds the sequences; decode-shaped
forwards on CUDA can be replayed from CUDA graphs (see graphs.py), which attend over the whole row.
"""

from __future__ import annotations

import torch

from eyas.engine.kv_cache import KVCache
from eyas.layers.attention import AttentionBatch
from eyas.models.llama import ModelOutput

KV_BUCKET = 128


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
        self.graphs = None  # set by enable_cuda_graphs()

    def kv_len_for(self, starts: list[int], num_new: int) -> int:
        need = max(starts) + num_new
        return min(self.max_len, -(-need // KV_BUCKET) * KV_BUCKET)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: list[int], starts: list[int],
                new_mask: torch.Tensor | None = None, graph: bool = True) -> ModelOutput:
        """input_ids, positions: [B, T] on the device; new tokens are written at starts[b] + [0, T).
        `graph=False` keeps a forward eager (prefills: their many shapes would each need a graph)."""
        B, T = input_ids.shape
        if graph and self.graphs is not None and self.graphs.can_run(B, T):
            return self.graphs.run(input_ids, positions, slots, starts, new_mask)
        batch = AttentionBatch(
            kv=self.kv,
            slots=torch.tensor(slots, device=self.device),
            starts=torch.tensor(starts, device=self.device),
            kv_len=self.kv_len_for(starts, T),
            new_mask=new_mask,
        )
        return self.model(input_ids, positions, batch)
