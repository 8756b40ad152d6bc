"""The draft's reduced vocabulary: the most frequent target tokens the assistant writes -> d2t / t2d.

Usage: mapping = build_mapping(samples, vocab_size=49152, draft_vocab_size=8192); save_mapping(mapping, path)

Draft id i stands for target id used[i], with `used` sorted ascending; checkpoints store the offset
d2t[i] = used[i] - i (EAGLE/SGLang convention) and the membership mask t2d over the target vocabulary.
Only loss-masked (assistant) tokens are counted: those are the tokens the draft will be asked to guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.errors import EyasError
from eyas.models.tensor_file import save_tensors


@dataclass
class VocabMapping:
    d2t: torch.Tensor     # [draft_vocab] int64 offsets
    t2d: torch.Tensor     # [vocab] bool
    coverage: float       # share of counted tokens inside the draft vocabulary

    @property
    def used(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel())


def count_tokens(samples, vocab_size: int) -> torch.Tensor:
    """How often each target token is a loss-masked (assistant) token, in one bincount over all of them. A
    bincount and an add per sample took ~46 µs a sample alone (2-core VM), but over nine minutes for 72,000
    samples on the H200 host with two vocabulary stages at once, their threads contending
    (benchmarks/bench_vocab_count.py)."""
    if not samples:
        return torch.zeros(vocab_size, dtype=torch.long)
    ids = torch.cat([s.input_ids for s in samples])[torch.cat([s.loss_mask for s in samples])].long()
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise EyasError(f"token id {int(ids.max())} is outside the target vocabulary ({vocab_size})")
    return torch.bincount(ids, minlength=vocab_size)


def mapping_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise EyasError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size} (the target vocabulary)")
    # Stable sort: ties (including all the unseen tokens) go to the lowest ids, so a dataset with fewer
    # distinct tokens than draft_vocab_size is padded with the lowest unused ids, deterministically.
    order = torch.sort(-counts, stable=True).indices
    used = order[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    total = int(counts.sum())
    coverage = float(counts[used].sum()) / total if total else 0.0
    return VocabMapping(used - torch.arange(draft_vocab_size), t2d, coverage)


def coverage_by_size(counts: torch.Tensor, sizes=(4096, 8192, 16384, 32768)) -> dict[int, float]:
    """Share of the counted tokens that the `size` most frequent ones cover, for each size up to the
    vocabulary: what a smaller or larger draft vocabulary would cover, read off the same counts. Every
    token outside the draft vocabulary is a draft guess that cannot be right."""
    total = int(counts.sum())
    if not total:
        return {}
    top = torch.sort(counts, descending=True).values.cumsum(0)
    return {s: float(top[s - 1]) / total for s in sizes if s <= counts.numel()}


def build_mapping(samples, vocab_size: int, draft_vocab_size: int) -> VocabMapping:
    return mapping_from_counts(count_tokens(samples, vocab_size), draft_vocab_size)


def save_mapping(mapping: VocabMapping, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_tensors({"d2t": mapping.d2t, "t2d": mapping.t2d}, tmp, metadata={"coverage": repr(mapping.coverage)})
    os.replace(tmp, path)


def load_mapping(path: Path) -> VocabMapping:
    if not path.is_file():
        raise EyasError(f"no vocabulary mapping at {path}; run `eyas train vocab` first")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        coverage = float((f.metadata() or {}).get("coverage", "nan"))
    t = load_file(str(path))
    return VocabMapping(t["d2t"].long(), t["t2d"].bool(), coverage)
