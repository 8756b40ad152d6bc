"""Tokenized training samples kept next to the run, so that a resumed run, or a stage run alone, does not
tokenize every conversation again (24,000 regenerated conversations took 47-93 s on the H200 host).

Usage: samples, stats = load(path, key) or (None, None); save(path, key, samples, stats)

The key covers everything the tokens depend on: the conversations, the tokenizer (its vocabulary size and
chat template) and max_len. A file that does not match, or cannot be read, is ignored and rewritten: the
cache can only save time, never change what training sees.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from eyas.train.atomic import write_atomic
from eyas.train.conversation import Sample


def cache_key(convs, tokenizer, max_len: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([len(tokenizer), getattr(tokenizer, "chat_template", None) or "", max_len]).encode())
    for c in convs:
        h.update(json.dumps(c.messages, ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\0")
    return h.hexdigest()


def save(path: Path, key: str, samples: list[Sample], stats: dict):
    from safetensors.torch import save

    tensors = {"input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int64),
               "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
               "lengths": torch.tensor([len(s) for s in samples], dtype=torch.int64)}
    write_atomic(path, save(tensors, metadata={"key": key, "stats": json.dumps(stats)}))


def load(path: Path, key: str) -> tuple[list[Sample], dict] | None:
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            ids, mask, lengths = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("lengths")
            stats = json.loads(meta["stats"])
    except (SafetensorError, OSError, KeyError, ValueError):
        return None
    if int(lengths.sum()) != ids.numel() or ids.numel() != mask.numel():
        return None
    samples = [Sample(i.clone(), m.bool()) for i, m in zip(ids.split(lengths.tolist()), mask.split(lengths.tolist()))]
    return samples, stats
