"""Offline features on disk: safetensors shards of whole samples, written atomically, read by sample.

Usage: with ShardWriter(dir, rank=0, shard_tokens=1 << 17) as w: w.add(i, ids, mask, features, hidden)
       store = FeatureStore(dir); batch = store.fetch([3, 7, 9])

A shard is written to a temporary file and renamed into place, so a shard that exists is complete:
a crash or a full disk leaves no half-written shard, and `eyas train capture` resumes by skipping the
samples that complete shards already hold. `index.json`, written last, marks the capture finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from eyas.errors import EyasError
from eyas.train.atomic import write_atomic
from eyas.train.batches import Batch, pad_rows

INDEX = "index.json"


class ShardWriter:
    def __init__(self, directory: Path, rank: int = 0, shard_tokens: int = 1 << 17):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f".shard-r{rank}-*.tmp"):
            stale.unlink()  # a temporary file from a killed run is never a shard
        self.rank, self.shard_tokens = rank, shard_tokens
        self.next_shard = len(list(self.dir.glob(f"shard-r{rank}-*.safetensors")))
        self.rows: list[tuple] = []
        self.tokens = 0

    def add(self, sample_id: int, input_ids, loss_mask, features, hidden):
        self.rows.append((sample_id, input_ids.cpu(), loss_mask.cpu(), features.cpu(), hidden.cpu()))
        self.tokens += input_ids.numel()
        if self.tokens >= self.shard_tokens:
            self.flush()

    def flush(self):
        if not self.rows:
            return
        lengths = torch.tensor([r[1].numel() for r in self.rows])
        tensors = {
            "sample_ids": torch.tensor([r[0] for r in self.rows], dtype=torch.long),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "input_ids": torch.cat([r[1] for r in self.rows]).long(),
            "loss_mask": torch.cat([r[2] for r in self.rows]).to(torch.uint8),
            "features": torch.cat([r[3] for r in self.rows]).contiguous(),
            "hidden": torch.cat([r[4] for r in self.rows]).contiguous(),
        }
        write_atomic(self.dir / f"shard-r{self.rank}-{self.next_shard:05d}.safetensors", save(tensors))
        self.next_shard += 1
        self.rows, self.tokens = [], 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.flush()


def shard_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("shard-r*-*.safetensors"))


def captured_ids(directory: Path) -> set[int]:
    """Samples already held by complete shards (resuming a capture skips them)."""
    out = set()
    for f in shard_files(directory):
        with safe_open(str(f), framework="pt") as fh:
            out.update(fh.get_tensor("sample_ids").tolist())
    return out


def write_index(directory: Path, info: dict):
    write_atomic(Path(directory) / INDEX, json.dumps(info, indent=2).encode())


class FeatureStore:
    """Random access by sample index over all shards (memory-mapped; only the rows asked for are read)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        index = self.dir / INDEX
        if not index.is_file():
            raise EyasError(f"no finished feature capture in {self.dir} (no {INDEX}); run `eyas train capture`")
        self.info = json.loads(index.read_text())
        self.handles, self.where = [], {}
        for f in shard_files(self.dir):
            fh = safe_open(str(f), framework="pt")
            offsets = fh.get_tensor("offsets").tolist()
            for j, sid in enumerate(fh.get_tensor("sample_ids").tolist()):
                self.where[sid] = (len(self.handles), offsets[j], offsets[j + 1])
            self.handles.append(fh)
        if len(self.where) != self.info.get("samples"):
            raise EyasError(f"{self.dir} holds {len(self.where)} samples, its index says {self.info.get('samples')}; "
                            "capture again")

    def lengths(self) -> list[int]:
        return [self.where[i][2] - self.where[i][1] for i in range(len(self.where))]

    def row(self, sid: int):
        h, a, b = self.where[sid]
        fh = self.handles[h]
        return tuple(fh.get_slice(k)[a:b] for k in ("input_ids", "loss_mask", "features", "hidden"))

    def fetch(self, ids: list[int]) -> Batch:
        rows = [self.row(i) for i in ids]
        return Batch(ids, pad_rows([r[0] for r in rows]), pad_rows([r[1].bool() for r in rows], False),
                     pad_rows([r[2] for r in rows]), pad_rows([r[3] for r in rows]))
