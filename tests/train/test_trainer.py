"""Training lowers the loss; a resumed run equals an uninterrupted one; offline features equal online."""

import json
import pytest
import torch

from eyas.models.loader import load_model
from eyas.train.capture import capture_features
from eyas.train.distributed import DistInfo
from eyas.train.draft_init import new_draft
from eyas.train.recipe import DraftSection, TrainConfig
from eyas.train.shards import FeatureStore
from eyas.train.sources import OfflineSource, OnlineSource
from eyas.train.target import TargetHeads
from eyas.train.trainer import Trainer
from eyas.train.vocab import build_mapping

DRAFT_VOCAB = 64


def make_trainer(target_dir, samples, out, mode="online", dist_info=None, **train):
    cfg = TrainConfig(**{"steps": 6, "batch_tokens": 512, "lr": 1e-3, "warmup_steps": 2, "ttt_steps": 3,
                         "log_every": 1, "checkpoint_every": 100, "mode": mode, "shard_tokens": 300, **train})
    mapping = build_mapping(samples, 320, DRAFT_VOCAB)
    target = load_model(target_dir, "fp32", "cpu")
    draft = new_draft(target.config, DraftSection(draft_vocab_size=DRAFT_VOCAB), mapping, seed=cfg.seed)
    target.capture_layers = draft.config.capture_layers(target.config.num_layers)
    info = dist_info or DistInfo()
    args = (cfg.batch_tokens, cfg.seed, mapping.used, mapping.t2d, "cpu", info.rank, info.world)
    weights = dict(repeat_weight=cfg.repeat_weight, repeat_ngram=cfg.repeat_ngram,
                   teacher_temperature=cfg.teacher_temperature)
    if mode == "online":
        source = OnlineSource(target, samples, *args, **weights)
    else:
        capture_features(out / "features", target, samples, "hash", cfg, info, progress=False)
        source = OfflineSource(TargetHeads.load(target_dir, torch.float32, "cpu"), FeatureStore(out / "features"), *args,
                               **weights)
    return Trainer(cfg, draft, source, out, "cpu", dist_info=info, progress=False)


def test_training_lowers_the_loss(tiny_target, samples, tmp_path):
    tr = make_trainer(tiny_target, samples, tmp_path, steps=25, warmup_steps=3)
    summary = tr.fit()
    losses = [r["loss"] for r in tr.history if "loss" in r]
    assert summary["steps"] == 25 and len(losses) == 25
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    acc0 = [r["acc_k"][0] for r in tr.history if "acc_k" in r]
    assert sum(acc0[-5:]) > sum(acc0[:5])
    assert (tmp_path / "checkpoints" / "step-000025" / "draft.safetensors").is_file()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 25


def test_resume_gives_identical_weights(tiny_target, samples, tmp_path):
    straight = make_trainer(tiny_target, samples, tmp_path / "a", steps=8, checkpoint_every=4)
    straight.fit()
    first = make_trainer(tiny_target, samples, tmp_path / "b", steps=8, checkpoint_every=4)
    first.fit(until=6)  # "killed" at step 6: the step-4 checkpoint is the latest
    assert first.step == 6
    again = make_trainer(tiny_target, samples, tmp_path / "b", steps=8, checkpoint_every=4)
    again.fit()
    assert again.step == 8
    logged = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 9))  # steps 5 and 6 were redone, and logged once
    want, got = straight.draft.state_dict(), again.draft.state_dict()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # ... and the optimizer moments too, or the next step would differ.
    for a, b in zip(straight.opt.state_dict()["state"].values(), again.opt.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_signal_stops_training_with_a_checkpoint_and_the_run_resumes_to_the_same_weights(tiny_target, samples,
                                                                                            tmp_path):
    """SIGTERM (a time limit's) mid-run: the step under way finishes, a checkpoint of it is saved although no
    periodic one was due, the run stops with a clear error, the handler is given back, and the same command
    then ends where an uninterrupted run does."""
    import os
    import signal

    from eyas.train.interrupt import TrainingStopped

    straight = make_trainer(tiny_target, samples, tmp_path / "a", steps=8)
    straight.fit()
    first = make_trainer(tiny_target, samples, tmp_path / "b", steps=8)
    step = first.train_step

    def step_then_signal(batch):
        out = step(batch)
        if first.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    first.train_step = step_then_signal
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM at step 5 of 8; checkpoint saved"):
        first.fit()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert (tmp_path / "b" / "checkpoints" / "step-000005" / "state.pt").is_file()
    again = make_trainer(tiny_target, samples, tmp_path / "b", steps=8)
    again.fit()
    assert again.step == 8
    want, got = straight.draft.state_dict(), again.draft.state_dict()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_resume_refuses_another_recipe(tiny_target, samples, tmp_path):
    from eyas.errors import EyasError

    t = make_trainer(tiny_target, samples, tmp_path, steps=2, checkpoint_every=1)
    t.digest = "one"
    t.fit()
    other = make_trainer(tiny_target, samples, tmp_path, steps=4, checkpoint_every=1)
    other.digest = "two"
    with pytest.raises(EyasError, match="different recipe"):
        other.fit()


@pytest.mark.parametrize("repeat_weight,temperature", [(1.0, 1.0), (0.25, 1.0), (1.0, 0.5)],
                         ids=["eagle3-loss", "repeats-weighted", "sharpened-teacher"])
def test_offline_equals_online_at_step_one(tiny_target, samples, tmp_path, repeat_weight, temperature):
    weights = dict(repeat_weight=repeat_weight, repeat_ngram=2, teacher_temperature=temperature)
    online = make_trainer(tiny_target, samples, tmp_path / "on", **weights)
    offline = make_trainer(tiny_target, samples, tmp_path / "off", mode="offline", **weights)
    assert len(list((tmp_path / "off" / "features").glob("shard-*.safetensors"))) > 1  # several shards
    a = online.train_step(online.source.stream.next())
    b = offline.train_step(offline.source.stream.next())
    assert int(a["count"].sum()) == int(b["count"].sum()) > 0
    torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["acc"], b["acc"])
    for k, v in online.draft.state_dict().items():
        torch.testing.assert_close(v, offline.draft.state_dict()[k], rtol=1e-4, atol=1e-6)
    if (repeat_weight, temperature) != (1.0, 1.0):  # the setting reached the loss: it differs from EAGLE-3's
        plain = make_trainer(tiny_target, samples, tmp_path / "plain")
        c = plain.train_step(plain.source.stream.next())
        assert not torch.allclose(a["loss"], c["loss"]) and torch.equal(a["count"], c["count"])


def test_weight_decay_spares_norm_gains_and_biases(tiny_target, samples, tmp_path):
    """With weight decay, 1-D parameters (the norms' gains) sit in a group without it, and a step with a zero
    gradient leaves them as they were while the matrices shrink; without it, one group as before."""
    tr = make_trainer(tiny_target, samples, tmp_path / "a", weight_decay=0.5)
    groups = tr.opt.param_groups
    assert len(groups) == 2 and groups[0]["weight_decay"] == 0.5 and groups[1]["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and all(p.dim() < 2 for p in groups[1]["params"])
    named = dict(tr.draft.named_parameters())
    gains = [n for n, p in named.items() if p.dim() == 1]
    assert gains and sum(len(g["params"]) for g in groups) == len(named)
    before = {n: p.detach().clone() for n, p in named.items()}
    for p in named.values():
        p.grad = torch.zeros_like(p)
    tr.opt.step()
    for n, p in named.items():
        if p.dim() == 1:
            assert torch.equal(p, before[n]), n
        else:
            assert p.abs().sum() < before[n].abs().sum(), n
    assert len(make_trainer(tiny_target, samples, tmp_path / "b").opt.param_groups) == 1
