"""`eyas train` end to end on a tiny target: synth -> regen -> vocab -> fit (with Engine evals) -> export -> eval,
then each stage alone: regeneration resumes, offline capture + fit run from the same data."""

import json
import shutil

import pytest
import torch

from eyas.cli import main
from eyas.config import ModelConfig
from eyas.errors import EyasError
from eyas.models.draft_io import load_draft
from eyas.train.prompts import read_conversations
from tests.train.conftest import write_sharegpt

RECIPE = """
name = "tiny"
target = "{target}"
out_dir = "{out}"
device = "cpu"
[data]
sharegpt = ["{sharegpt}"]
heldout = 2
max_len = 96
eval_sets = ["mt-bench"]
[synth]
num = 4
max_tokens = 24
min_chars = 1
min_ascii_ratio = 0.0
batch = 8
[regen]
temperature = 1.0
max_tokens = 24
batch = 8
[draft]
draft_vocab_size = 64
[train]
steps = 4
batch_tokens = 384
ttt_steps = 3
lr = 1e-3
warmup_steps = 1
log_every = 2
checkpoint_every = 2
[eval]
every = 2
num_prompts = 2
max_tokens = 8
batch = 2
ignore_eos = true  # this random target's greedy choice after a prompt is to end the turn
[export]
layouts = ["sglang", "speculators"]
"""


def _mtbench_question():
    from eyas.bench.datasets import load_prompts

    try:
        return load_prompts("mt-bench")[0].messages[0]["content"]
    except EyasError:
        return None  # the package is not installed: the contamination check is skipped, not failed


@pytest.fixture
def recipe(chatty_target, tmp_path, monkeypatch):
    sharegpt = write_sharegpt(tmp_path / "sharegpt.jsonl", n=8)
    question = _mtbench_question()
    if question:
        with open(sharegpt, "a") as f:
            f.write(json.dumps({"id": "leak", "conversations": [{"from": "human", "value": question}]}) + "\n")
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE.format(target=chatty_target, out=tmp_path / "out", sharegpt=sharegpt))
    return path, tmp_path / "out", question


def test_whole_pipeline_then_stages_alone(recipe, chatty_target, capsys, monkeypatch):
    path, out, question = recipe
    assert main(["train", "--config", str(path), "--no-progress"]) == 0
    log = capsys.readouterr().err
    for stage in ("synth", "regen", "vocab", "fit", "export", "eval"):
        assert f"[{stage}]" in log  # one timing line per stage
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "ok" and run["data_hash"] and run["output"] == str(out / "draft")
    assert set(run["stages"]) == {"synth", "regen", "vocab", "fit", "export", "eval"}
    assert run["stages"]["eval"]["accept_length"] >= 1.0
    assert run["config"]["train"]["steps"] == 4
    if question:
        assert run["stages"]["regen"]["eval_overlap"] == 1

    # Data: synthesized prompts, regenerated replies, held-out prompts never trained on.
    synth = read_conversations(out / "data" / "synth-r0.jsonl")
    assert len(synth) == 4
    rows = [json.loads(x) for x in (out / "data" / "regen-r0.jsonl").read_text().splitlines()]
    kept = [r for r in rows if "dropped" not in r]  # dropped ids are recorded, so a resume never retries them
    assert kept and all(r["conversations"][-1]["from"] == "gpt" for r in kept)
    heldout = {c.id for c in read_conversations(out / "data" / "heldout.jsonl")}
    assert len(heldout) == 2 and not heldout & {r["id"] for r in rows} and "leak" not in {r["id"] for r in rows}
    assert len(rows) == run["stages"]["regen"]["train"]

    # Training record: metrics, evals with the real Engine at steps 0, 2, 4, the plot, checkpoints.
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "accept_length" in r] == [0, 2, 4]
    for r in rows:  # each eval also scores its held-out replies teacher-forced, one accuracy per chain step
        if "accept_length" in r:
            assert len(r["heldout_acc_k"]) == 3 and all(0.0 <= a <= 1.0 for a in r["heldout_acc_k"])
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert (out / "metrics.png").stat().st_size > 1000

    # Exports load as drafts of this target, in both layouts, with the trained vocabulary.
    cfg = ModelConfig.from_dir(chatty_target)
    sg = load_draft(out / "draft", cfg)
    sp = load_draft(out / "draft-speculators", cfg)
    assert json.loads((out / "draft" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert torch.equal(sg.d2t, sp.d2t) and sg.config.draft_vocab_size == 64
    vocab = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(out / "vocab.safetensors"))
    assert torch.equal(sg.d2t, vocab["d2t"])

    # Regeneration is resumable: nothing is left to do, nothing is written twice.
    before = (out / "data" / "regen-r0.jsonl").read_text()
    assert main(["train", "regen", "--config", str(path), "--no-progress"]) == 0
    assert (out / "data" / "regen-r0.jsonl").read_text() == before

    # The tokenized conversations are kept: a stage run alone reads them instead of tokenizing again,
    # and records the same data hash.
    assert (out / "samples.safetensors").is_file()
    with monkeypatch.context() as m:
        m.setattr("eyas.train.conversation.encode_all",
                  lambda *a, **k: pytest.fail("tokenized again despite an up-to-date cache"))
        assert main(["train", "vocab", "--config", str(path), "--no-progress"]) == 0
    assert json.loads((out / "run.json").read_text())["data_hash"] == run["data_hash"]

    # Offline from the same data: capture features, then fit from disk.
    off = out.parent / "off"
    off.mkdir()
    shutil.copytree(out / "data", off / "data")
    shutil.copy(out / "vocab.safetensors", off / "vocab.safetensors")
    args = ["--config", str(path), "--out", str(off), "--mode", "offline", "--steps", "2", "--set", "eval.every=0",
            "--no-progress"]
    assert main(["train", "capture", *args]) == 0
    assert (off / "features" / "index.json").is_file()
    assert main(["train", "fit", *args]) == 0
    assert json.loads((off / "run.json").read_text())["stages"]["fit"]["steps"] == 2


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('target = "x"\n[train]\nsteps = -1\n')
    assert main(["train", "--config", str(bad)]) == 2
    assert "steps must be positive" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    capsys.readouterr()
    assert main(["train", "fit", "--config", str(bad), "--set", "train.steps=3", "--out", str(tmp_path / "o"),
                 "--device", "cpu"]) == 2
    assert "no regenerated conversations" in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "run.json").read_text())["status"] == "failed"


def test_profiled_generation_stages_report_prefill_and_decode(recipe, capsys):
    path, out, _ = recipe
    assert main(["train", "synth", "--config", str(path), "--no-progress", "--profile"]) == 0
    log = capsys.readouterr().err
    assert "[synth] engine phases" in log
    table = log.split("[synth] engine phases")[1]
    assert "prefill" in table and "decode" in table and "acceptance" not in table
