"""Attention over the slot KV cache behind a small interface.

`AttentionBatch` is the per-forward metadata (buildable by hand in a test); `prepare` derives the
mask once per forward. The reference path is torch SDPA with an explicit boolean mask, which
handles prefill, decode, several-token appends and tree verification alike: a tree is just a
`new_mask` other than the causal one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.engine.kv_cache import KVCache


@dataclass
class AttentionBatch:
    kv: KVCache
    slots: torch.Tensor            # [B] cache row of each sequence
    starts: torch.Tensor           # [B] tokens already cached before this forward
    kv_len: int                    # cache columns attended over; >= max(starts) + T
    new_mask: torch.Tensor | None = None  # [B, T, starts - visible + T] which recent columns each token sees
    visible: torch.Tensor | None = None   # [B] columns always visible; default = starts (causal/tree verify)
    mask: torch.Tensor | None = None      # [B, 1, T, kv_len], filled by prepare()
    write_pos: torch.Tensor | None = None  # [B, T]

    def prepare(self, num_new: int) -> "AttentionBatch":
        device = self.starts.device
        t = torch.arange(num_new, device=device)
        self.write_pos = self.starts[:, None] + t[None, :]
        cols = torch.arange(self.kv_len, device=device)
        if self.new_mask is None:
            rel = cols[None, None, :] - self.starts[:, None, None]          # [B, 1, kv_len]
            past = rel < 0
            new = (rel >= 0) & (rel <= t[None, :, None])
        else:
            # Columns from `visible` on (earlier draft-tree nodes and the new tokens) follow new_mask.
            visible = self.starts if self.visible is None else self.visible
            width = self.new_mask.shape[-1]
            rel = cols[None, None, :] - visible[:, None, None]
            past = rel < 0
            inside = (rel >= 0) & (rel < width)
            idx = rel.clamp(0, width - 1).expand(-1, num_new, -1)
            new = inside & torch.gather(self.new_mask, 2, idx)
        self.mask = (past | new).unsqueeze(1)
        return self


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: AttentionBatch, scale: float):
    """q: [B, T, H, D]; k, v: [B, T, Hkv, D] for the new tokens. Returns [B, T, H*D]."""
    batch.kv.write(layer, batch.slots, batch.write_pos, k, v)
    keys, values = batch.kv.read(layer, batch.slots, batch.kv_len)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=batch.mask,
                                         scale=scale, enable_gqa=keys.shape[1] != q.shape[2])
    return out.transpose(1, 2).flatten(2)
