"""Bad input is one clear EyasError, and a failed write never leaves a corrupt shard or checkpoint."""

import errno

import pytest
import torch

from eyas.config import ModelConfig
from eyas.errors import EyasError
from eyas.models.loader import load_model
from eyas.train import atomic
from eyas.train.capture import capture_features
from eyas.train.checkpoint import latest_checkpoint, load_draft_checkpoint, load_state, save_checkpoint
from eyas.train.distributed import DistInfo
from eyas.train.draft_init import draft_config_for, new_draft
from eyas.train.recipe import DraftSection, TrainConfig, parse_recipe
from eyas.train.shards import FeatureStore
from eyas.train.vocab import build_mapping
from tests.helpers import random_draft


def _disk_full(path, data):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_while_capturing_features(tiny_target, samples, tmp_path, monkeypatch):
    target = load_model(tiny_target, "fp32", "cpu")
    target.capture_layers = (2, 2, 3)
    cfg = TrainConfig(batch_tokens=512, shard_tokens=300)
    monkeypatch.setattr(atomic, "write_bytes", _disk_full)
    with pytest.raises(EyasError, match="disk full"):
        capture_features(tmp_path / "f", target, samples, "h", cfg, DistInfo(), progress=False)
    left = sorted(p.name for p in (tmp_path / "f").iterdir())
    assert left == ["manifest.json"] or left == []  # no shard, no temporary file, no index
    with pytest.raises(EyasError, match="no finished feature capture"):
        FeatureStore(tmp_path / "f")
    # With room again, the capture completes and every sample is readable.
    monkeypatch.undo()
    capture_features(tmp_path / "f", target, samples, "h", cfg, DistInfo(), progress=False)
    store = FeatureStore(tmp_path / "f")
    assert store.lengths() == [len(s) for s in samples]


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    draft = random_draft(64, 32, draft_vocab=24)
    save_checkpoint(tmp_path, 1, draft, {"data": [{"epoch": 0, "index": 1}]})
    saved = draft.fc.weight.detach().clone()
    with torch.no_grad():
        draft.fc.weight.add_(1.0)
    monkeypatch.setattr(atomic, "write_bytes", _disk_full)
    with pytest.raises(EyasError, match="disk full"):
        save_checkpoint(tmp_path, 2, draft, {"data": [{"epoch": 0, "index": 2}]})
    monkeypatch.undo()
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step-000001" and load_state(latest)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    restored = load_draft_checkpoint(latest)
    assert torch.equal(restored.fc.weight, saved)


def test_draft_that_does_not_fit_the_target(tiny_target, samples, tmp_path):
    cfg = ModelConfig.from_dir(tiny_target)
    with pytest.raises(EyasError, match="exceeds the target's vocabulary"):
        draft_config_for(cfg, DraftSection(draft_vocab_size=cfg.vocab_size + 1))
    with pytest.raises(EyasError, match="do not fit a target with 5 layers"):
        draft_config_for(cfg, DraftSection(draft_vocab_size=64, aux_layer_ids=[0, 2, 4]))
    with pytest.raises(EyasError, match="must list 3 layers"):
        DraftSection(aux_layer_ids=[1, 2])
    mapping = build_mapping(samples, cfg.vocab_size, 32)
    with pytest.raises(EyasError, match="does not match the draft"):
        new_draft(cfg, DraftSection(draft_vocab_size=64), mapping)
    # An existing draft made for another target (hidden 32 vs 64) is refused when used as a starting point.
    from eyas.models.draft_io import save_draft

    save_draft(random_draft(32, cfg.vocab_size, draft_vocab=32), tmp_path / "other")
    with pytest.raises(EyasError, match="target hidden size"):
        new_draft(cfg, DraftSection(draft_vocab_size=32, init_from=str(tmp_path / "other")), mapping)


@pytest.mark.parametrize("data, match", [
    ({}, "lacks 'target'"),
    ({"target": "demo", "trian": {}}, "unknown key 'trian'"),
    ({"target": "demo", "train": {"stpes": 3}}, r"unknown key 'stpes' in \[train\]"),
    ({"target": "demo", "train": {"steps": "many"}}, "steps must be int"),
    ({"target": "demo", "train": {"mode": "sideways"}}, "mode must be one of"),
    ({"target": "demo", "train": {"steps": 0}}, "steps must be positive"),
    ({"target": "demo", "data": {"sharegpt": "one.json"}}, "must be a list"),
    ({"target": "demo", "export": {"layouts": ["gguf"]}}, "layouts must name"),
    ({"target": "demo", "synth": {"min_ascii_ratio": 2}}, "min_ascii_ratio"),
    ({"target": "demo", "synth": {"system_prompts": ["Ask about code.", 3]}}, "system_prompts must be a list of strings"),
    ({"target": "demo", "synth": {"system_prompts": "Ask about code."}}, "must be a list"),
    ({"target": "demo", "synth": {"openers": ["Write", None]}}, "openers must be a list of strings"),
    ({"target": "demo", "synth": {"plain_per_opener": -1}}, "plain_per_opener must be >= 0"),
    ({"target": "demo", "synth": {"plain_per_opener": 1.5}}, "plain_per_opener must be int"),
    ({"target": "demo", "train": {"repeat_weight": -0.5}}, "repeat_weight must be >= 0"),
    ({"target": "demo", "train": {"repeat_ngram": 0}}, "repeat_ngram must be positive"),
    ({"target": "demo", "train": {"teacher_temperature": 0}}, "teacher_temperature must be > 0"),
])
def test_recipe_mistakes(data, match):
    with pytest.raises(EyasError, match=match):
        parse_recipe(data)


def test_recipe_overrides_and_the_committed_recipe():
    from pathlib import Path

    from eyas.train.recipe import load_recipe

    r = load_recipe(Path(__file__).parents[2] / "recipes" / "smollm2-135m-eagle3.toml",
                    {"device": "cpu", "train.steps": 7, "out_dir": "/tmp/x"})
    assert r.target == "demo" and r.train.steps == 7 and r.device == "cpu" and r.out_dir == "/tmp/x"
    assert r.target_dtype() == "fp32"
    assert parse_recipe({"target": "t", "train": {"lr": 1}}).train.lr == 1.0  # ints are fine for floats
