"""Training checkpoints: draft + optimizer + scheduler + RNG + data position, written atomically.

Usage: save_checkpoint(ckpt_dir, step, draft, state, keep=2); found = latest_checkpoint(ckpt_dir)

Layout: checkpoints/step-000200/{draft.safetensors, draft_config.json, state.pt} and a `latest` file
naming the newest. A checkpoint directory is renamed into place only when complete, and `latest` is
updated after it, so an interrupted or disk-full save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eyas.draft_config import DraftConfig
from eyas.errors import EyasError
from eyas.models.eagle3 import Eagle3Draft
from eyas.train import atomic

LATEST = "latest"


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, step: int, draft: Eagle3Draft, state: dict, keep: int = 2) -> Path:
    """`state`: optimizer/scheduler state dicts, data position, anything torch.save(weights_only) can read."""
    directory = Path(directory)
    final = directory / f"step-{step:06d}"
    tensors = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    buf = io.BytesIO()
    torch.save({**state, "step": step, "rng": rng_state()}, buf)
    with atomic.atomic_dir(final) as tmp:
        atomic.write_bytes(tmp / "draft.safetensors", save(tensors))
        atomic.write_bytes(tmp / "draft_config.json", json.dumps(draft.config.to_dict(), indent=2).encode())
        atomic.write_bytes(tmp / "state.pt", buf.getvalue())
    atomic.write_atomic(directory / LATEST, final.name.encode())
    steps = sorted(p for p in directory.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not (path / "state.pt").is_file():
        raise EyasError(f"{pointer} names {path.name}, which is incomplete or missing")
    return path


def load_draft_checkpoint(path: Path, max_positions: int | None = None) -> Eagle3Draft:
    cfg = DraftConfig(**json.loads((path / "draft_config.json").read_text()))
    draft = Eagle3Draft(cfg, max_positions)
    try:
        draft.load_state_dict(load_file(str(path / "draft.safetensors")))
    except Exception as e:
        raise EyasError(f"cannot load the draft from checkpoint {path}: {str(e).splitlines()[0]}") from None
    return draft


def load_state(path: Path) -> dict:
    try:
        return torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise EyasError(f"cannot read training state {path / 'state.pt'}: {str(e).splitlines()[0]}") from None
