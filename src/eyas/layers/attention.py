"""Attention over the slot KV cache behind a small interface.

`AttentionBatch` is the per-forward metadata (buildable by hand in a test); `prepare` derives the
write positions once per forward, and the mask on first use. The reference path is torch SDPA with an
explicit boolean mask, which handles prefill, decode, several-token appends and tree verification
alike: a tree is just a `new_mask` other than the causal one. On CUDA, decode-shaped forwards (up to
KERNEL_TOKENS new tokens) instead run eyas.kernels.slot_attention, which reads each sequence's cache
row in place over that row's own length, with the same visibility rule; `rotate_and_attend` also folds
the rotary embedding into the kernel that writes the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.layers.kv_cache import KVCache
from eyas.kernels import enabled


@dataclass
class AttentionBatch:
    kv: KVCache
    slots: torch.Tensor            # [B] cache row of each sequence
    starts: torch.Tensor           # [B] tokens already cached before this forward
    kv_len: int                    # cache columns attended over; >= max(starts) + T
    new_mask: torch.Tensor | None = None  # [B, T, starts - visible + T] which recent columns each token sees
    visible: torch.Tensor | None = None   # [B] columns always visible; default = starts (causal/tree verify)
    write_pos: torch.Tensor | None = None  # [B, T], filled by prepare()
    _mask: torch.Tensor | None = None

    def prepare(self, num_new: int) -> "AttentionBatch":
        self.write_pos = self.starts[:, None] + torch.arange(num_new, device=self.starts.device)[None, :]
        self._mask = None
        return self

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, T, kv_len] which cache columns each new token sees (built once per forward, when needed)."""
        if self._mask is None:
            self._mask = self._build_mask(self.write_pos.shape[1])
        return self._mask

    def _build_mask(self, num_new: int) -> torch.Tensor:
        device = self.starts.device
        t = torch.arange(num_new, device=device)
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
        return (past | new).unsqueeze(1)


KERNEL_TOKENS = 64  # new tokens per row up to which the slot-attention kernel runs (decode, verify, draft)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: AttentionBatch, scale: float):
    """q: [B, T, H, D]; k, v: [B, T, Hkv, D] for the new tokens. Returns [B, T, H*D]."""
    if slot_kernel_fits(q, batch):
        from eyas.kernels.slot_attention import store_kv

        store_kv(batch.kv.k[layer], batch.kv.v[layer], batch.slots, batch.write_pos, k, v)
        return attend_cached(q, layer, batch, scale)
    keys, values = _write_and_read(batch, layer, k, v)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=batch.mask,
                                         scale=scale, enable_gqa=keys.shape[1] != q.shape[2])
    return out.transpose(1, 2).flatten(2)


def _write_and_read(batch: AttentionBatch, layer: int, k: torch.Tensor, v: torch.Tensor):
    """Store this forward's k, v and return the cache's [B, kv_heads, kv_len, D] keys and values. A single
    row on the CPU is written and read by slicing (views, no index kernels): a batch-1 cycle's cache traffic
    there was a large share of the verify pass through advanced indexing. Other batches use the cache's
    indexed write and an index_select read, which copies only the kv_len columns it needs."""
    kv = batch.kv
    if batch.slots.device.type == "cpu" and batch.slots.shape[0] == 1:
        row, start, num_new = int(batch.slots[0]), int(batch.starts[0]), k.shape[1]
        kv.k[layer, row, :, start:start + num_new] = k[0].transpose(0, 1)
        if not kv.shared:
            kv.v[layer, row, :, start:start + num_new] = v[0].transpose(0, 1)
        return kv.k[layer, row:row + 1, :, :batch.kv_len], kv.v[layer, row:row + 1, :, :batch.kv_len]
    kv.write(layer, batch.slots, batch.write_pos, k, v)
    return (kv.k[layer, :, :, :batch.kv_len].index_select(0, batch.slots),
            kv.v[layer, :, :, :batch.kv_len].index_select(0, batch.slots))


def rotate_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rotary,
                      layer: int, batch: AttentionBatch, scale: float):
    """Rotary embedding of q and k, then `attend`. On the kernel path the rotation and the cache write are
    one launch (eyas.kernels.rotary.rotate_and_store), the same bits, or the attention kernel does both
    itself, one launch fewer per layer (`rotary_in_attention`)."""
    if slot_kernel_fits(q, batch) and enabled(k, v) and q.dtype == k.dtype == v.dtype == batch.kv.k.dtype:
        from eyas.kernels.rotary import rotate_and_store

        if rotary_in_attention(q):
            return attend_cached(q, layer, batch, scale, (k, v, rotary.cos, rotary.sin, positions, batch.write_pos))
        q = rotate_and_store(q, k, v, rotary.cos, rotary.sin, positions, batch.kv.k[layer], batch.kv.v[layer],
                             batch.slots, batch.write_pos)
        return attend_cached(q, layer, batch, scale)
    q, k = rotary(q, k, positions)
    return attend(q, k, v, layer, batch, scale)


def attend_cached(q: torch.Tensor, layer: int, batch: AttentionBatch, scale: float, rotary: tuple | None = None):
    """The slot-attention kernel over this layer's cache, where this forward's k and v are written already
    (or, with `rotary`, which the kernel rotates and writes itself: eyas.kernels.slot_attention). [B, T, H*D]."""
    from eyas.kernels.slot_attention import slot_attention

    return slot_attention(q, batch.kv.k[layer], batch.kv.v[layer], batch.slots, batch.starts, scale,
                          new_mask=batch.new_mask, visible=batch.visible, kv_len=batch.kv_len, rotary=rotary)


# Query width (heads x head dim, per rank) from which the attention kernel rotates q and k itself by default.
# That made an 8B shape's decode step (width 4,096) faster and SmolLM2's (width 576) slower (docs/kernels.md):
# there the kernel's extra work outweighs the launch it saves. Widths in between were not measured.
ROTARY_IN_ATTENTION_MIN_WIDTH = 2048


def rotary_in_attention(q: torch.Tensor) -> bool:
    """Whether the attention kernel rotates q and k and writes the cache itself: from
    ROTARY_IN_ATTENTION_MIN_WIDTH on. q: [B, T, H, D]."""
    return rotary_in_attention_at(q.shape[-2] * q.shape[-1])


def rotary_in_attention_at(width: int) -> bool:
    """rotary_in_attention for a query of this width (heads x head dim, per rank)."""
    return width >= ROTARY_IN_ATTENTION_MIN_WIDTH


def slot_kernel_fits(q: torch.Tensor, batch: AttentionBatch) -> bool:
    """Whether the slot-attention kernel takes these queries [B, T, ...] over the batch's cache: at most
    KERNEL_TOKENS per row, on a device and dtype it runs on, over a cache it reads (kernel_reads_cache)."""
    return q.shape[1] <= KERNEL_TOKENS and enabled(q) and kernel_reads_cache(batch.kv)


def kernel_reads_cache(kv: KVCache) -> bool:
    """Whether decode-shaped forwards over this cache run the slot-attention kernel, which reads each row
    over its own length: then how many columns a forward may attend over costs nothing."""
    D = kv.k.shape[-1]
    return enabled(kv.k) and not kv.shared and D & (D - 1) == 0 and 32 <= D <= 256
