"""Offline capture: run the frozen target over the training samples once, keep features on disk.

Usage: capture_features(out / "features", target, samples, data_hash, recipe.train, dist_info)
       capture_features(out / "features", VllmCapture(url, layers, heads), samples, ...)   # target in vLLM

Per token we keep the fused features (3H) and the final hidden state (H), in the target's dtype:
4 * H values, about 4.6 KB a token for SmolLM2 in bf16, so 1M tokens is about 4.6 GB. Each rank
captures every world-th sample into its own shards; a manifest pins the data hash (and the engine that
computed the states) so features of other data are never mixed in, and resuming skips samples that
complete shards already hold. The target is eyas's own model (batched forwards, in-process) or a serving
engine (train/capture_engines.py: one prefill request per sample, `concurrency` of them in flight).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.train.atomic import write_atomic
from eyas.train.batches import collate_samples, plan_epoch
from eyas.train.shards import INDEX, ShardWriter, captured_ids, write_index
from eyas.train.target import run_target

MANIFEST = "manifest.json"


def capture_features(directory: Path, target, samples, data_hash: str, cfg, dist_info, progress=True,
                     dtype: str | None = None, concurrency: int = 8) -> dict:
    """`target`: an eyas CausalLM with capture_layers set, or an engine capture (its states are cast to `dtype`)."""
    directory = Path(directory)
    local = isinstance(target, torch.nn.Module)
    if not local:
        from eyas.models.loader import parse_dtype

        cast = parse_dtype(dtype)
    kind = next(target.parameters()).dtype if local else cast
    info = {"data_hash": data_hash, "samples": len(samples), "capture_layers": list(target.capture_layers),
            "dtype": str(kind).replace("torch.", "")}
    if not local:
        info["source"] = target.source  # an engine's states, not eyas's: resuming never mixes the two
    manifest = directory / MANIFEST
    if dist_info.main:
        old = json.loads(manifest.read_text()) if manifest.is_file() else None
        if old is not None and old != info:
            shutil.rmtree(directory)  # features of other data or another target: never mix them in
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(manifest, json.dumps(info).encode())
    dist_info.barrier()
    if (directory / INDEX).is_file():
        return {**info, "skipped": "already captured"}
    done = captured_ids(directory)
    mine = [i for i in range(len(samples)) if i % dist_info.world == dist_info.rank and i not in done]
    rows = _local_rows(target, samples, mine, cfg) if local else _engine_rows(target, samples, mine, cast,
                                                                              concurrency)
    captured = 0
    with ShardWriter(directory, dist_info.rank, cfg.shard_tokens) as writer:
        for sid, features, hidden in tqdm(rows, total=len(mine), desc="capture", unit="sample",
                                          disable=not progress):
            writer.add(sid, samples[sid].input_ids, samples[sid].loss_mask, features, hidden)
            captured += 1
    dist_info.barrier()
    if dist_info.main:
        write_index(directory, info)
    dist_info.barrier()
    return {**info, "samples_captured": captured, "bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors"))}


def _local_rows(target, samples, mine: list[int], cfg):
    """eyas's engine: length-bucketed batches through one forward each."""
    fetch = collate_samples(samples)
    device = next(target.parameters()).device
    plan = plan_epoch([len(samples[i]) for i in mine], cfg.batch_tokens, seed=0, epoch=0) if mine else []
    for local in plan:
        ids = [mine[j] for j in local]
        out = run_target(target, fetch(ids).input_ids.to(device))
        for row, sid in enumerate(ids):
            n = len(samples[sid])
            yield sid, out.features[row, :n], out.hidden[row, :n]


def _engine_rows(engine, samples, mine: list[int], cast: torch.dtype, concurrency: int):
    """A serving engine: one prefill per sample, several in flight so the engine batches them; yielded in order,
    so an interruption loses at most the shard being filled."""
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for start in range(0, len(mine), 4 * max(1, concurrency)):
            chunk = mine[start: start + 4 * max(1, concurrency)]
            for sid, (features, hidden) in zip(chunk, pool.map(
                    lambda i: engine.fetch(samples[i].input_ids.tolist()), chunk)):
                yield sid, features.to(cast), hidden.to(cast)
