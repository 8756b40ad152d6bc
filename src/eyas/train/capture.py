"""Offline capture: run the frozen target over the training samples once, keep features on disk.

Usage: capture_features(out / "features", target, samples, data_hash, recipe.train, dist_info)

Per token we keep the fused features (3H) and the final hidden state (H), in the target's dtype:
4 * H values, about 4.6 KB a token for SmolLM2 in bf16, so 1M tokens is about 4.6 GB. Each rank
captures every world-th sample into its own shards; a manifest pins the data hash so features of
other data are never mixed in, and resuming skips samples that complete shards already hold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tqdm import tqdm

from eyas.train.atomic import write_atomic
from eyas.train.batches import collate_samples, plan_epoch
from eyas.train.shards import INDEX, ShardWriter, captured_ids, write_index
from eyas.train.target import run_target

MANIFEST = "manifest.json"


def capture_features(directory: Path, target, samples, data_hash: str, cfg, dist_info, progress=True) -> dict:
    directory = Path(directory)
    info = {"data_hash": data_hash, "samples": len(samples), "capture_layers": list(target.capture_layers),
            "dtype": str(next(target.parameters()).dtype).replace("torch.", "")}
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
    fetch = collate_samples(samples)
    device = next(target.parameters()).device
    captured = 0
    with ShardWriter(directory, dist_info.rank, cfg.shard_tokens) as writer:
        plan = plan_epoch([len(samples[i]) for i in mine], cfg.batch_tokens, seed=0, epoch=0) if mine else []
        for local in tqdm(plan, desc="capture", unit="batch", disable=not progress):
            ids = [mine[j] for j in local]
            batch = fetch(ids).to(device)
            out = run_target(target, batch.input_ids)
            for row, sid in enumerate(ids):
                n = len(samples[sid])
                writer.add(sid, samples[sid].input_ids, samples[sid].loss_mask, out.features[row, :n],
                           out.hidden[row, :n])
                captured += 1
    dist_info.barrier()
    if dist_info.main:
        write_index(directory, info)
    dist_info.barrier()
    return {**info, "samples_captured": captured, "bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors"))}
