"""Hidden states a real vLLM (0.32, CPU build) writes are eyas's capture, and train the same draft.

One `vllm serve` of the demo target, launched as docs/training-large-targets.md says (`extract_hidden_states` with
the layers `vllm_launch_flags` names), with vLLM's ExampleHiddenStatesConnector run through a CPU subclass
(tests/peers/vllm_cpu_hidden_states.py: the stock one copies on CUDA streams). eyas sends its own token ids; the
fused features and final hidden states, in fp32, must match eyas's in-process capture token by token (REL), and a
short offline fit on either store gives the same loss curve.
"""

import json

import pytest
import torch

from eyas.config import ModelConfig
from eyas.errors import EyasError
from eyas.models.demo import demo_model_path
from eyas.models.loader import load_model
from eyas.models.tokenizer import load_tokenizer
from eyas.train.capture import capture_features
from eyas.train.capture_engines import VllmCapture, vllm_launch_flags
from eyas.train.conversation import encode_all
from eyas.train.distributed import DistInfo
from eyas.train.draft_init import draft_config_for, new_draft
from eyas.train.prompts import Conversation
from eyas.train.recipe import DraftSection, TrainConfig
from eyas.train.shards import FeatureStore
from eyas.train.sources import OfflineSource
from eyas.train.target import TargetHeads, run_target
from eyas.train.trainer import Trainer
from eyas.train.vocab import build_mapping
from tests.peers.envs import vllm_server

CHATS = [
    ("What is the capital of France?", "The capital of France is Paris, a city on the Seine."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nwhispers of the grey morning,\nthe garden drinks deep."),
    ("Explain recursion in one sentence.", "Recursion is when a function solves a problem by calling itself on "
                                           "smaller pieces of it until a simple case is reached."),
    ("Give me three prime numbers.", "Three prime numbers are 2, 3 and 5."),
]
# The same math in another engine's fp32 kernels, 30 layers deep, bounded per token (features reach ~2.5e4 at the
# first token, SmolLM2's attention sink, and ~1 elsewhere). Runs here gave 3.5e-6, but one full-suite run on a
# 2-core AMX Xeon gave up to 4e-4 on one prompt; eyas's side gave the same bits in every run tried, and the cause
# on vLLM's side was not found. A wrong layer or position is off by far more; bf16 values (up to 2.2e-3) by only
# twice REL, so fp32 is checked apart.
REL = 1e-3


@pytest.fixture(scope="module")
def demo():
    return str(demo_model_path())


@pytest.fixture(scope="module")
def layers(demo):
    cfg = ModelConfig.from_dir(demo)
    return draft_config_for(cfg, DraftSection(draft_vocab_size=256)).capture_layers(cfg.num_layers)


@pytest.fixture(scope="module")
def server(demo, layers, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-capture")
    flags = vllm_launch_flags(layers, ModelConfig.from_dir(demo).num_layers, str(root / "hidden"))
    kv = json.loads(flags[3])
    kv.update(kv_connector="CPUHiddenStatesConnector", kv_connector_module_path="vllm_cpu_hidden_states")
    with vllm_server(demo, flags[0], flags[1], flags[2], json.dumps(kv), log=root / "vllm.log") as url:
        yield url, root / "hidden"


@pytest.fixture(scope="module")
def samples(demo):
    tok = load_tokenizer(demo)
    convs = [Conversation(f"c{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
             for i, (q, a) in enumerate(CHATS)]
    return encode_all(tok, convs, 512, progress=False)[0]


def test_vllm_hidden_states_equal_eyas_capture(demo, layers, server, samples):
    url, storage = server
    target = load_model(demo, "fp32", "cpu")
    target.capture_layers = layers
    src = VllmCapture(url, layers, TargetHeads.load(demo, torch.float32, "cpu"))
    for s in samples:
        feats, hidden = src.fetch(s.input_ids.tolist())
        want = run_target(target, s.input_ids[None])
        for got, ref in ((feats, want.features[0]), (hidden, want.hidden[0])):
            assert got.shape == ref.shape and got.dtype == torch.float32
            assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < REL
        assert not torch.equal(feats, feats.bfloat16().float())  # fp32 values, not bf16 ones widened
    assert not list(storage.glob("*.safetensors*"))  # its scratch files are read once and removed


def test_a_server_launched_for_other_layers_is_refused(demo, server):
    """A server writing another number of layers than eyas asks for is one clear error, naming the launch setting
    to change (ids of the same count are beyond what vLLM's HTTP API tells: the final-state check covers L)."""
    url, _ = server
    src = VllmCapture(url, (2, 15), TargetHeads.load(demo, torch.float32, "cpu"))
    with pytest.raises(EyasError, match=r"relaunch vLLM with eagle_aux_hidden_state_layer_ids \[2, 15, 30\]"):
        src.fetch([1, 28, 9690, 198])


def test_a_fit_on_vllm_states_follows_the_same_loss_curve(demo, layers, server, samples, tmp_path):
    url, _ = server
    cfg = TrainConfig(steps=4, batch_tokens=1024, lr=1e-3, warmup_steps=1, ttt_steps=2, log_every=1,
                      checkpoint_every=100, mode="offline", shard_tokens=200)
    heads = TargetHeads.load(demo, torch.float32, "cpu")
    target = load_model(demo, "fp32", "cpu")
    target.capture_layers = layers
    engines = {"eyas": target, "vllm": VllmCapture(url, layers, heads)}
    mapping = build_mapping(samples, target.config.vocab_size, 256)
    curves = {}
    for name, source in engines.items():
        out = tmp_path / name
        res = capture_features(out / "features", source, samples, "hash", cfg, DistInfo(), progress=False,
                               dtype="fp32", concurrency=2)
        assert res["samples_captured"] == len(samples)
        draft = new_draft(target.config, DraftSection(draft_vocab_size=256), mapping, seed=0)
        data = OfflineSource(heads, FeatureStore(out / "features"), cfg.batch_tokens, cfg.seed, mapping.used,
                             mapping.t2d, "cpu", 0, 1)
        tr = Trainer(cfg, draft, data, out, "cpu", progress=False)
        tr.fit()
        curves[name] = [r["loss"] for r in tr.history if "loss" in r]
    assert len(curves["vllm"]) == cfg.steps
    assert curves["vllm"] == pytest.approx(curves["eyas"], rel=1e-4)


def test_plain_vllm_decodes_eyas_greedy_tokens(demo, server, samples):
    """The capture server is the target alone (its `extract_hidden_states` proposer drafts nothing): its greedy
    continuation of each prompt is eyas's, token for token."""
    import httpx

    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams

    url, _ = server
    prompts = [s.input_ids.tolist()[:20] for s in samples]
    engine = Engine(demo, dtype="fp32", device="cpu", max_batch=1, max_len=64)
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for ids in prompts:
            res = client.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 24,
                                                       "temperature": 0.0, "ignore_eos": True,
                                                       "return_token_ids": True}).json()
            want = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))[0].output_ids
            assert res["choices"][0]["token_ids"] == want
