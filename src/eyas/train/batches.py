"""Length-bucketed batches, deterministic per (seed, epoch), sharded by rank, resumable by position.

Usage: stream = BatchStream(lengths, batch_tokens=16384, seed=0, fetch=collate_samples(samples))
       batch = stream.next(); state = stream.state(); stream.load_state(state)

Why bucketing rather than packing: samples of similar length share a batch, padded on the right, so
every row is one conversation starting at position 0. The target's causal attention and the draft's
TTT masks need no per-document boundaries, and the features match what inference computes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from eyas.errors import EyasError

CHUNK = 64  # batches' worth of samples shuffled together before sorting by length


@dataclass
class Batch:
    ids: list[int]                       # sample indices
    input_ids: torch.Tensor              # [B, T]
    loss_mask: torch.Tensor              # [B, T] bool; padding is False
    features: torch.Tensor | None = None  # offline: [B, T, 3H]
    hidden: torch.Tensor | None = None    # offline: [B, T, H]

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return Batch(self.ids, move(self.input_ids), move(self.loss_mask), move(self.features), move(self.hidden))

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffle, sort chunks by length, cut into batches of at most `batch_tokens` padded tokens, shuffle batches."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    per_chunk = max(1, CHUNK * batch_tokens // max(1, max(lengths)))
    batches = []
    for c in range(0, len(order), per_chunk):
        chunk = sorted(order[c: c + per_chunk], key=lambda i: -lengths[i])
        cur, longest = [], 0
        for i in chunk:
            if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, lengths[i])
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


class BatchStream:
    """Endless batches for one rank; `state()` is the data position a checkpoint stores."""

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int, fetch: Callable[[list[int]], Batch],
                 rank: int = 0, world: int = 1):
        if not lengths:
            raise EyasError("no training samples")
        if max(lengths) > batch_tokens:
            raise EyasError(f"a sample has {max(lengths)} tokens, more than [train] batch_tokens = {batch_tokens}; "
                            "raise batch_tokens or lower [data] max_len")
        self.lengths, self.batch_tokens, self.seed, self.fetch = lengths, batch_tokens, seed, fetch
        self.rank, self.world = rank, world
        self.epoch, self.index = 0, 0
        self._plan = None

    def _rank_plan(self) -> list[list[int]]:
        if self._plan is None:
            plan = plan_epoch(self.lengths, self.batch_tokens, self.seed, self.epoch)
            # Every rank takes the same number of batches, or DDP would wait forever for the short one.
            usable = len(plan) // self.world * self.world
            if usable == 0:
                raise EyasError(f"{len(plan)} batches per epoch cannot feed {self.world} ranks; "
                                "lower [train] batch_tokens or add data")
            self._plan = plan[:usable][self.rank::self.world]
        return self._plan

    def next(self) -> Batch:
        plan = self._rank_plan()
        if self.index >= len(plan):
            self.epoch, self.index, self._plan = self.epoch + 1, 0, None
            plan = self._rank_plan()
        ids = plan[self.index]
        self.index += 1
        return self.fetch(ids)

    def batches_per_epoch(self) -> int:
        return len(self._rank_plan())

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict):
        self.epoch, self.index, self._plan = int(state["epoch"]), int(state["index"]), None


def pad_rows(rows: list[torch.Tensor], value=0) -> torch.Tensor:
    T = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), T, *rows[0].shape[1:]), value)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def collate_samples(samples) -> Callable[[list[int]], Batch]:
    """Online batches: tokens and masks only; the target computes the rest on the device."""
    def fetch(ids: list[int]) -> Batch:
        return Batch(ids, pad_rows([samples[i].input_ids for i in ids]),
                     pad_rows([samples[i].loss_mask for i in ids], False))
    return fetch
