"""The tiny INT4 Kimi-K2 target (tests/models/test_int4_model.py), given a tokenizer, behind the real front ends:
`eyas serve` with an EAGLE-3 draft returns the plain greedy text and reports the packed weights' bytes in
/server_info and its serving log line, and `eyas train` trains a draft for it end to end on the CPU."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from eyas.cli import main
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from eyas.models.draft_io import load_draft, save_draft
from eyas.models.loader import load_model, safetensors_files, weight_bytes
from eyas.models.quant import packed_bytes
from eyas.models.tokenizer import load_tokenizer
from tests.helpers import random_draft
from tests.models.test_int4_model import ship_int4
from tests.server.tiny import Server
from tests.train.conftest import VOCAB, build_tokenizer, write_sharegpt


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The packed target with a byte-level BPE and a ChatML template (vocabulary VOCAB)."""
    packed_dir, _ = ship_int4(tmp_path_factory.mktemp("int4-chat"), vocab=VOCAB)
    build_tokenizer(packed_dir)
    return packed_dir


def test_serves_plain_greedy_with_a_draft_and_reports_packed_bytes(target, tmp_path):
    draft = tmp_path / "draft"
    save_draft(random_draft(64, VOCAB, draft_vocab=64), draft, dtype=torch.float32)
    tok = load_tokenizer(target)
    prompts = [f"Question {i}: how are the {'abc'[i % 3]} waves" for i in range(3)]
    plain = Engine(str(target), dtype="fp32", max_batch=1, max_len=256)
    want = [tok.decode(plain.generate([tok.encode(p)], SamplingParams(max_tokens=16))[0].output_ids,
                       skip_special_tokens=True) for p in prompts]
    args = ["--draft", str(draft), "--spec-steps", "3", "--no-spec-adaptive", "--dtype", "fp32",
            "--max-model-len", "256", "--max-running", "2"]
    with Server(target, *args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=180)
        got = [client.completions.create(model=server.model, prompt=p, max_tokens=16, temperature=0).choices[0].text
               for p in prompts]
        info = httpx.get(server.url + "/server_info").json()["model"]
        assert f"weights {info['weight_bytes'] / 2 ** 20:.1f} MiB + KV cache" in server.log()  # the serving line
    assert got == want
    assert info["speculative"]
    assert info["weight_bytes"] == weight_bytes(load_model(target, "fp32", max_positions=256))
    packed, kv = packed_bytes(safetensors_files(target), torch.float32), info["kv_cache_bytes"]
    assert kv > 0 and abs((info["weight_bytes"] + kv) / (packed + kv) - 1) <= 0.10


RECIPE = """
name = "int4"
target = "{target}"
out_dir = "{out}"
device = "cpu"
[data]
sharegpt = ["{sharegpt}"]
heldout = 1
max_len = 64
[synth]
num = 2
max_tokens = 12
min_chars = 1
min_ascii_ratio = 0.0
[regen]
max_tokens = 12
[draft]
draft_vocab_size = 64
[train]
steps = 2
batch_tokens = 128
ttt_steps = 2
warmup_steps = 1
log_every = 1
checkpoint_every = 2
[eval]
every = 2
num_prompts = 1
max_tokens = 8
ignore_eos = true
[export]
layouts = ["sglang"]
"""


def test_trains_a_draft_end_to_end(target, tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    sharegpt = write_sharegpt(tmp_path / "sharegpt.jsonl", n=4)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE.format(target=target, out=tmp_path / "out", sharegpt=sharegpt))
    assert main(["train", "--config", str(recipe), "--no-progress"]) == 0
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["status"] == "ok" and run["stages"]["fit"]["steps"] == 2
    losses = [json.loads(x)["loss"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert run["stages"]["eval"]["accept_length"] >= 1.0
    draft = load_draft(tmp_path / "out" / "draft", load_model(target, "fp32").config)
    assert draft.config.draft_vocab_size == 64
