"""A tiny INT4 DeepSeek-V3 / Kimi-K2 model (random weights, packed here as compressed-tensors pack-quantized)
loads at its packed size, computes exactly what its dequantized twin computes (the capture's hidden states
included), and speculates losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from eyas.config import SpecConfig
from eyas.dist.launch import free_port
from eyas.engine.engine import Engine
from eyas.engine.profile import Profiler
from eyas.layers.quant_linear import QuantLinear
from eyas.layers.sampling import SamplingParams
from eyas.models.loader import load_model, safetensors_files, weight_bytes
from eyas.models.quant import dequantize_int4, pack_int4_groups, packed_bytes
from eyas.models.quant_experts import QuantExperts
from eyas.train.target import run_target
from tests.helpers import random_draft
from tests.models.tiny_moe import save_tiny
from tests.models.tp_ranks import logits, tp_worker

VOCAB = 32  # small, so a random draft still gets tokens accepted


def int4_config(group: int, symmetric: bool) -> dict:
    """Kimi-K2's quantization_config (compressed-tensors pack-quantized), with the group and symmetry asked for."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
               "group_size": group or None, "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "output_activations": None, "weights": weights}},
            "ignore": ["lm_head"]}


def every_linear(key: str) -> bool:
    """DeepSeek-style: every projection in the layers (dense and expert) but the router."""
    return ".layers." in key and not key.endswith("mlp.gate.weight")


def ship_int4(root: Path, name: str = "kimi_k2", vocab: int = VOCAB, select=every_linear, group: int = 32,
              symmetric: bool = True) -> tuple[Path, Path]:
    """(packed, twin): the tiny model packed as compressed-tensors int4 (bf16 scales, as Kimi ships them), and
    its dequantized twin, a dense fp32 checkpoint holding the format's values (dequantize_int4)."""
    packed_dir, twin = root / "int4", root / "twin"
    save_tiny(name, twin, vocab_size=vocab)
    dense, packed = load_file(twin / "model.safetensors"), {}
    for key, w in dense.items():
        if select(key) and w.dim() == 2:
            parts = pack_int4_groups(w, group, symmetric)
            parts["weight_scale"] = parts["weight_scale"].to(torch.bfloat16)
            dense[key] = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], group,
                                         parts.get("weight_zero_point"))
            packed.update({key[: -len("weight")] + piece: t for piece, t in parts.items()})
        else:
            packed[key] = w
    save_file(dense, twin / "model.safetensors")
    packed_dir.mkdir()
    save_file({k: t.contiguous() for k, t in packed.items()}, packed_dir / "model.safetensors")
    cfg = json.loads((twin / "config.json").read_text())
    (packed_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": int4_config(group, symmetric)}))
    return packed_dir, twin


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return ship_int4(tmp_path_factory.mktemp("int4"))


def test_loads_at_its_packed_size(pair):
    packed_dir, twin = pair
    # The rotary table (a buffer, not a weight) is kept short: at 256 positions it is a tenth of this tiny model.
    model, dense = load_model(packed_dir, "fp32", max_positions=64), load_model(twin, "fp32", max_positions=64)
    assert all(isinstance(m, QuantLinear) for n, m in model.named_modules() if n.endswith(("o_proj", "kv_b_proj")))
    assert isinstance(model.model.layers[1].mlp.experts, QuantExperts)
    packed, loaded = packed_bytes(safetensors_files(packed_dir), torch.float32), weight_bytes(model)
    print(f"\npacked {packed} B, loaded {loaded} B ({loaded / packed:.3f}x), dequantized twin {weight_bytes(dense)} B")
    assert abs(loaded / packed - 1) <= 0.10
    assert weight_bytes(dense) > 1.5 * loaded  # the twin holds every packed weight dense
    engine = Engine(str(packed_dir), dtype="fp32", max_batch=2, max_len=128)
    kv = engine.runner.kv.bytes()
    held = weight_bytes(engine.target) + kv
    print(f"engine: weights + KV cache {held} B, packed + KV cache {packed + kv} B ({held / (packed + kv):.3f}x)")
    assert abs(held / (packed + kv) - 1) <= 0.10


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_capture_matches_its_dequantized_twin(pair, dtype):
    """The hidden states training captures (run_target: fused features and final hidden state) are the twin's,
    bit for bit: the packed weights dequantize to the twin's values in the compute dtype."""
    packed_dir, twin = pair
    model, dense = load_model(packed_dir, dtype), load_model(twin, dtype)
    model.capture_layers = dense.capture_layers = (1, 2, 3)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    got, want = run_target(model, ids), run_target(dense, ids)
    assert torch.equal(got.features, want.features) and torch.equal(got.hidden, want.hidden)
    assert torch.equal(model.logits(got.hidden), dense.logits(want.hidden))


@pytest.mark.parametrize("group, symmetric", [(16, False), (0, True)], ids=["group16-zero-points", "channel"])
def test_other_schemes_match_their_twins(tmp_path, group, symmetric):
    """Zero points and per-row scales, on the routed experts only (as Kimi-K2 quantizes)."""
    packed_dir, twin = ship_int4(tmp_path, select=lambda k: ".mlp.experts." in k, group=group, symmetric=symmetric)
    model, dense = load_model(packed_dir, "fp32"), load_model(twin, "fp32")
    assert model.model.layers[1].mlp.experts.gate_up_proj_zero_point is not None or symmetric
    model.capture_layers = dense.capture_layers = (1, 2, 3)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    got, want = run_target(model, ids), run_target(dense, ids)
    assert torch.equal(got.features, want.features) and torch.equal(got.hidden, want.hidden)


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_speculative_equals_plain_greedy_and_the_twin(pair, spec):
    packed_dir, twin = pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = [SamplingParams(max_tokens=n) for n in (20, 30, 30)]
    want = [s.output_ids for s in Engine(str(twin), dtype="fp32", max_batch=3, max_len=128).generate(prompts, params)]
    plain = Engine(str(packed_dir), dtype="fp32", max_batch=3, max_len=128)
    assert [s.output_ids for s in plain.generate(prompts, params)] == want
    prof = Profiler("cpu")
    spec_engine = Engine(str(packed_dir), dtype="fp32", max_batch=3, max_len=128, profiler=prof,
                         draft=random_draft(64, VOCAB, draft_vocab=24), spec=spec)
    assert [s.output_ids for s in spec_engine.generate(prompts, params)] == want
    assert max(prof.summary()["accept_histogram"]) > 1  # accepted drafts, so commit/compaction ran


def test_tp2_ranks_keep_their_packed_slices(tmp_path):
    """Two gloo ranks over the packed model: heads, kv_b_proj's rows, o_proj's and down_proj's columns and every
    expert's intermediate dim split in two, each piece cut on its 16-wide groups; logits equal the twin's."""
    packed_dir, twin = ship_int4(tmp_path, vocab=96, group=16)
    mp.spawn(tp_worker, args=(free_port(), str(packed_dir), str(tmp_path)), nprocs=2, join=True)
    want = logits(load_model(twin, "fp32", "cpu"))
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
