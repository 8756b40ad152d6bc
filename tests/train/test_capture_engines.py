"""Capture from SGLang's HTTP API, and the engine-capture settings of recipe and command line.

SGLang cannot capture on this CPU (its CPU engine needs Intel AMX and a source build of sgl-kernel; EAGLE-3 there
needs a GPU), so its path is tested against responses in the shape SGLang documents for `/generate` with
`return_hidden_states` (`meta_info.hidden_states`: the prefill's [prompt_tokens][width] first, then one entry per
decoded token; `output_ids`; `meta_info.prompt_tokens`), their values eyas's own forward of a tiny target: the
features server's width is the fused layers', the plain server's the final hidden state's.
"""

import json
import threading

import httpx
import pytest
import torch

from eyas.errors import EyasError
from eyas.models.loader import load_model
from eyas.train.capture import capture_features
from eyas.train.capture_engines import SglangCapture
from eyas.train.distributed import DistInfo
from eyas.train.recipe import TrainConfig, parse_recipe
from eyas.train.shards import FeatureStore
from eyas.train.target import TargetHeads, run_target

LAYERS = (2, 2, 3)
FEATURES_URL, HIDDEN_URL = "http://features:30000", "http://hidden:30001"


def sglang_transport(target, requests: list, break_with: dict | None = None):
    """Answers /generate as two SGLang servers would: EAGLE-3 (features) at FEATURES_URL, plain at HIDDEN_URL."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append((request.url.host, request.url.path, body))
        ids = torch.tensor([body["input_ids"]])
        out = run_target(target, ids)
        nxt = int(target.logits(out.hidden[0, -1:]).argmax(-1))
        states = out.features[0] if request.url.host == "features" else out.hidden[0]
        meta = {"id": "r0", "prompt_tokens": ids.shape[1], "completion_tokens": 1, "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": 1},
                "hidden_states": [states.tolist(), states[-1].tolist()]}
        res = {"text": "x", "output_ids": [nxt], "meta_info": meta}
        for key, value in (break_with or {}).items():
            if request.url.host == key:
                res = value(res)
        return httpx.Response(200, json=res)

    return httpx.MockTransport(handle)


@pytest.fixture
def target(tiny_target):
    model = load_model(tiny_target, "fp32", "cpu")
    model.capture_layers = LAYERS
    return model


def test_sglang_capture_gives_eyas_features_from_the_engines_token_ids(tiny_target, target, samples, tmp_path):
    sent = []
    heads = TargetHeads.load(tiny_target, torch.float32, "cpu")
    src = SglangCapture(FEATURES_URL, HIDDEN_URL, LAYERS, heads, transport=sglang_transport(target, sent))
    cfg = TrainConfig(batch_tokens=512, shard_tokens=300, mode="offline")
    res = capture_features(tmp_path / "f", src, samples, "h", cfg, DistInfo(), progress=False, dtype="fp32",
                           concurrency=1)
    assert res["source"] == "sglang" and res["samples_captured"] == len(samples)
    # Every request is a one-token prefill of eyas's token ids, to both servers.
    assert {(host, path) for host, path, _ in sent} == {("features", "/generate"), ("hidden", "/generate")}
    assert all(b["sampling_params"]["max_new_tokens"] == 1 and b["return_hidden_states"] for _, _, b in sent)
    assert sorted(tuple(b["input_ids"]) for h, _, b in sent if h == "features") == \
        sorted(tuple(s.input_ids.tolist()) for s in samples)
    store = FeatureStore(tmp_path / "f")
    for i in (0, len(samples) - 1):
        want = run_target(target, samples[i].input_ids[None])
        ids, mask, feats, hidden = store.row(i)
        assert torch.equal(ids, samples[i].input_ids)
        torch.testing.assert_close(feats, want.features[0], rtol=0, atol=0)
        torch.testing.assert_close(hidden, want.hidden[0], rtol=0, atol=0)


@pytest.mark.parametrize("host, breaks, message", [
    ("features", lambda r: {**r, "meta_info": {k: v for k, v in r["meta_info"].items() if k != "hidden_states"}},
     "--enable-return-hidden-states"),
    ("hidden", lambda r: {**r, "meta_info": {**r["meta_info"], "hidden_states": [
        [row + row for row in r["meta_info"]["hidden_states"][0]]]}}, "final states of shape"),
    ("hidden", lambda r: {**r, "output_ids": [(r["output_ids"][0] + 1) % 300]}, "does not predict the token"),
])
def test_a_misconfigured_sglang_server_is_one_clear_error(tiny_target, target, host, breaks, message):
    heads = TargetHeads.load(tiny_target, torch.float32, "cpu")
    src = SglangCapture(FEATURES_URL, HIDDEN_URL, LAYERS, heads,
                        transport=sglang_transport(target, [], {host: breaks}))
    with pytest.raises(EyasError, match=message):
        src.fetch([1, 5, 9, 12, 40])


def test_engine_capture_settings_are_checked_when_the_recipe_is_read():
    r = parse_recipe({"target": "demo", "train": {"mode": "offline"},
                      "capture": {"source": "vllm", "url": "http://gpu-node:8000"}})
    assert (r.capture.source, r.capture.url) == ("vllm", "http://gpu-node:8000")
    with pytest.raises(EyasError, match=r"\[capture\] source must be one of eyas, vllm, sglang"):
        parse_recipe({"target": "demo", "capture": {"source": "trtllm"}})
    with pytest.raises(EyasError, match="needs url"):
        parse_recipe({"target": "demo", "train": {"mode": "offline"}, "capture": {"source": "sglang"}})
    with pytest.raises(EyasError, match='set \\[train\\] mode = "offline"'):
        parse_recipe({"target": "demo", "capture": {"source": "vllm", "url": "http://x:1"}})


def test_the_command_line_sets_the_capture_source():
    import argparse

    from eyas.train.cli import add_arguments, overrides_from

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["capture", "--config", "r.toml", "--source", "sglang", "--engine-url", "http://a:1",
                         "--engine-hidden-url", "http://b:2"])
    got = overrides_from(args)
    assert (got["capture.source"], got["capture.url"], got["capture.hidden_url"]) == ("sglang", "http://a:1",
                                                                                      "http://b:2")


def test_replies_from_an_openai_endpoint_equal_eyas_regeneration(tiny_target, tmp_path):
    """[regen] url: the server gets eyas's chat-templated token ids and the same seeds; greedy, its replies are
    the ones eyas's own engine writes, multi-turn included, in the same files."""
    from eyas.layers.sampling import SamplingParams
    from eyas.train.pipeline import Pipeline
    from eyas.train.prompts import build_pool
    from eyas.train.regen import regenerate
    from eyas.train.regen_endpoint import regenerate_via_endpoint
    from tests.train.conftest import write_sharegpt

    sharegpt = write_sharegpt(tmp_path / "sharegpt.jsonl", n=6)

    def recipe(out):
        return parse_recipe({"target": str(tiny_target), "out_dir": str(out), "device": "cpu",
                             "data": {"sharegpt": [str(sharegpt)], "heldout": 2, "max_len": 256, "max_turns": 2,
                                      "eval_sets": []},
                             "regen": {"temperature": 0.0, "max_tokens": 8, "batch": 4}})

    local, remote = recipe(tmp_path / "local"), recipe(tmp_path / "remote")
    p = Pipeline(local, progress=False)
    engine = p.engine(4, 256)
    regenerate(local, engine, p.tokenizer, build_pool(local, write=True).train, progress=False)
    bodies, one_at_a_time = [], threading.Lock()  # requests arrive from several threads; the engine is not shared

    def handle(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        bodies.append(body)
        with one_at_a_time:
            seq = engine.generate([body["prompt"]], SamplingParams(
                temperature=body["temperature"], top_p=body["top_p"], max_tokens=body["max_tokens"],
                seed=body["seed"], stop_token_ids=tuple(body["stop_token_ids"])))[0]
        text = p.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return httpx.Response(200, json={"choices": [{"text": text, "token_ids": seq.output_ids}]})

    stats = regenerate_via_endpoint(remote, p.tokenizer, p.target_config.eos_token_ids,
                                    build_pool(remote, write=True).train, "http://gpu-node:8000/v1",
                                    progress=False, concurrency=3, transport=httpx.MockTransport(handle))
    read = lambda r: sorted((tmp_path / r / "data").glob("regen-r0.jsonl"))[0].read_text().splitlines()
    by_id = lambda r: {row["id"]: row for row in map(json.loads, read(r))}
    assert by_id("remote") == by_id("local")
    assert stats["conversations"] == len(by_id("remote")) and stats["replies"] > stats["conversations"]
    assert all(b["model"] == "tiny" and isinstance(b["prompt"][0], int) for b in bodies)
