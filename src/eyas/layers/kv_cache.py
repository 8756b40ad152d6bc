"""KV cache: one row ("slot") per live sequence, all layers in one tensor.

Designed for speculation: a forward appends T tokens at once at positions [start, start+T) of each
slot; rollback is free (the engine just keeps the shorter length: stale entries past it are masked
and later overwritten); `compact_path` moves the accepted nodes of a verified tree to contiguous positions.
With `shared`, keys and values are one tensor (MLA caches one latent per token that serves as both).
Slot accounting (`allocate`/`free`) lets the scheduler admit requests only while rows are free.
"""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.kernels import enabled


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, shared: bool = False):
        shape = (num_layers, num_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = self.k if shared else torch.zeros(shape, dtype=dtype, device=device)
        self.shared = shared
        self.max_len = max_len
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    # -- slot accounting ----------------------------------------------------------------------
    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int):
        self._free.append(slot)

    def allocate_scratch(self) -> int:
        """Reserve the highest row for writes nobody reads (padding of fixed-shape batches)."""
        self._free.remove(self.num_slots - 1)
        return self.num_slots - 1

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def bytes(self) -> int:
        return (1 if self.shared else 2) * self.k.numel() * self.k.element_size()

    # -- tensor operations --------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, write_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, T, kv_heads, D] written at rows `slots` [B], columns `write_pos` [B, T]."""
        rows = slots[:, None].expand_as(write_pos)
        self.k[layer][rows, :, write_pos] = k
        if not self.shared:
            self.v[layer][rows, :, write_pos] = v

    def read(self, layer: int, slots: torch.Tensor, kv_len: int):
        """[B, kv_heads, kv_len, D] views (a gather copy when the slots are not a plain range)."""
        return self.k[layer, slots, :, :kv_len], self.v[layer, slots, :, :kv_len]

    def compact_path(self, slots: torch.Tensor, starts: torch.Tensor, sel: torch.Tensor, accepted: torch.Tensor):
        """Move a verified tree's accepted path to contiguous columns in every layer: row slots[i]'s columns
        starts[i] + sel[i, j] to starts[i] + j for j <= accepted[i] (past it, column starts[i] onto itself).
        slots, starts, accepted [n], sel [n, L]; every column is read before any is written, so a path that skips
        nodes may move a column onto one that moves itself. With the kernels enabled, one launch
        (eyas.kernels.kv_compact); the plan's tree_kernels=False keeps the torch ops (execution_plan)."""
        if execution_plan.current().tree_kernels and enabled(self.k):
            from eyas.kernels.kv_compact import kv_compact

            kv_compact(self.k, None if self.shared else self.v, slots, starts, sel, accepted)
            return
        cols = torch.arange(sel.shape[1], device=sel.device)[None]
        src = starts[:, None] + sel
        dst = starts[:, None] + torch.where(cols <= accepted[:, None], cols, 0)
        rows = slots[:, None]
        self.k[:, rows, :, dst] = self.k[:, rows, :, src]
        if not self.shared:
            self.v[:, rows, :, dst] = self.v[:, rows, :, src]
