"""Quantized checkpoints as shipped (DeepSeek-V3 FP8 blocks, Kimi-K2 compressed-tensors int4) load kept
quantized and match HF running the dequantized weights; the int4 reader follows the format's bit layout."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from eyas.config import ModelConfig
from eyas.errors import EyasError
from eyas.models.loader import load_model
from eyas.layers.quant_linear import QuantLinear
from eyas.models.quant import FP8, dequantize_fp8, dequantize_int4, pack_int4_groups, quantize_fp8_blocks
from eyas.models.quant_experts import QuantExperts
from tests.models.tiny_moe import assert_matches_hf, build_hf

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
INT4_CONFIG = {  # Kimi-K2-Thinking's, trimmed
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head"],
}


def test_int4_reader_follows_the_packing_layout():
    """Eight values per int32, value j in bits 4j..4j+3, stored as value + 8 (compressed-tensors pack_to_int32)."""
    values = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, -1], [7, 6, 5, 4, 3, 2, 1, 0]])
    words = [0x7BA9F810, 0x89ABCDEF]  # nibbles low to high: 0 1 8 15 9 10 11 7 / 15 14 13 12 11 10 9 8
    packed = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w] for w in words], dtype=torch.int32)
    scale = torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16)
    got = dequantize_int4(packed, scale, torch.tensor([2, 8]), group=8)
    assert torch.equal(got, values.float() * scale.float())
    # The writer makes the same word where its absmax/7 scale is the one used here (row 2 reaches +7).
    assert torch.equal(pack_int4_groups(got[1:], 8)["weight_packed"], packed[1:])


def test_int4_zero_points_pack_down_the_rows():
    """Asymmetric schemes: weight_zero_point [ceil(out/8), groups], value i of a word the zero point of row 8p + i
    (compressed-tensors pack_to_int32 with packed_dim=0), stored + 8; w = (q - z) * scale."""
    rows = 9  # two words down the rows, the second holding one zero point
    zeros = torch.tensor([[-8, 7, 0, 1, 2, 3, 4, -1, 5]]).T  # one group per row
    words = [0x7CBA98F0, 0xD]  # nibbles low to high: 0 15 8 9 10 11 12 7 / 13
    zp = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w] for w in words], dtype=torch.int32)
    packed = torch.full((rows, 1), 0x88888888 - (1 << 32), dtype=torch.int32)  # every value q = 0
    scale = torch.full((rows, 1), 0.5)
    got = dequantize_int4(packed, scale, torch.tensor([rows, 8]), group=8, zero_point=zp)
    assert torch.equal(got, (-zeros.float() * 0.5).expand(rows, 8))
    parts = pack_int4_groups(torch.randn(rows, 16), 8, symmetric=False)
    assert parts["weight_zero_point"].shape == (2, 2) and parts["weight_scale"].shape == (rows, 2)


def test_int4_round_trip_groups_and_ragged_packing():
    w = torch.randn(6, 96)
    parts = pack_int4_groups(w, 32)
    assert parts["weight_packed"].shape == (6, 12) and parts["weight_scale"].shape == (6, 3)
    deq = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], 32)
    step = parts["weight_scale"].repeat_interleave(32, 1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()  # within half a quantization step everywhere
    odd = pack_int4_groups(torch.randn(3, 20), 4)       # 20 columns: the last word is half padding
    assert odd["weight_packed"].shape == (3, 3)
    assert dequantize_int4(odd["weight_packed"], odd["weight_scale"], odd["weight_shape"], 4).shape == (3, 20)
    for group, symmetric in ((0, True), (32, False), (0, False)):  # "channel" (one group per row), zero points
        parts = pack_int4_groups(w, group, symmetric)
        deq = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], group,
                              parts.get("weight_zero_point"))
        step = parts["weight_scale"].repeat_interleave(group or 96, 1)
        assert ((deq - w).abs() <= step / 2 + 1e-6).all(), (group, symmetric)


def test_fp8_blocks_scale_multiplies_per_block():
    w = torch.randn(40, 24)
    q, scale_inv = quantize_fp8_blocks(w, [16, 16])
    assert q.dtype == FP8 and scale_inv.shape == (3, 2)  # ceil(40/16), ceil(24/16)
    deq = dequantize_fp8(q, scale_inv, [16, 16])
    assert deq[33, 17] == q[33, 17].float() * scale_inv[2, 1]
    assert ((deq - w).abs() <= w.abs() / 16 + scale_inv.max() / 64).all()  # e4m3: 3 mantissa bits


def _ship(tmp_path, name, quantize, select, quant_config, model_type=None):
    """A tiny checkpoint in `ref/` (the dequantized weights, dense) and `q/` (as shipped, two shards)."""
    ref, shipped = tmp_path / "ref", tmp_path / "q"
    build_hf(name).save_pretrained(ref)
    dense, quantized = load_file(ref / "model.safetensors"), {}
    for key, w in dense.items():
        if select(key) and w.dim() == 2:
            pieces, dense[key] = quantize(w)
            quantized.update({key[: -len("weight")] + piece: t for piece, t in pieces.items()})
        else:
            quantized[key] = w
    save_file(dense, ref / "model.safetensors")
    shipped.mkdir()
    # Scales and weights in different shards: the loader must pair pieces across files.
    names = sorted(quantized)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": [k for j, k in enumerate(names) if j % 2 == i] for i in (0, 1)}
    for file, keys in shards.items():
        save_file({k: quantized[k].contiguous() for k in keys}, shipped / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (shipped / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((ref / "config.json").read_text())
    cfg.update(quantization_config=quant_config, model_type=model_type or cfg["model_type"])
    (shipped / "config.json").write_text(json.dumps(cfg))
    return transformers.DeepseekV3ForCausalLM.from_pretrained(ref, dtype=torch.float32).eval(), shipped


# The references are computed from the definitions, not with the loader's readers.
def _fp8(w):
    q, s = quantize_fp8_blocks(w, [16, 16])
    rows, cols = w.shape
    return {"weight": q, "weight_scale_inv": s}, q.float() * torch.kron(s, torch.ones(16, 16))[:rows, :cols]


def _int4(w):
    parts = pack_int4_groups(w, 32)
    parts["weight_scale"] = parts["weight_scale"].to(torch.bfloat16)  # Kimi ships bf16 scales
    per_col = parts["weight_scale"].float().repeat_interleave(32, 1)
    # The writer rounds against its fp32 scale; the shipped bf16 scale then multiplies the integers.
    ints = (w / pack_int4_groups(w, 32)["weight_scale"].repeat_interleave(32, 1)).round().clamp(-8, 7)
    return parts, ints * per_col


def test_deepseek_fp8_checkpoint_matches_dequantized_reference(tmp_path):
    # DeepSeek-V3 quantizes every linear in the layers except the router; embeddings, norms and lm_head stay bf16.
    hf, path = _ship(tmp_path, "deepseek_v3", _fp8, lambda k: ".layers." in k and not k.endswith("mlp.gate.weight"),
                     FP8_CONFIG)
    ours = load_model(path, "fp32", "cpu")
    assert ours.config.quantization == {"method": "fp8", "block": [16, 16]}
    attn, moe = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    assert isinstance(attn.kv_b_proj, QuantLinear) and attn.kv_b_proj.weight.dtype == FP8  # kept in fp8
    assert isinstance(moe.experts, QuantExperts) and moe.experts.gate_up_proj.dtype == FP8
    assert isinstance(ours.model.layers[0].mlp.gate_up_proj, QuantLinear)  # the dense layer's fused gate/up
    assert_matches_hf(ours, hf)


def test_kimi_int4_checkpoint_matches_dequantized_reference(tmp_path):
    # Kimi-K2-Thinking quantizes the routed experts only.
    hf, path = _ship(tmp_path, "kimi_k2", _int4, lambda k: ".mlp.experts." in k, INT4_CONFIG, model_type="kimi_k2")
    ours = load_model(path, "fp32", "cpu")
    assert ours.config.family == "kimi_k2"
    assert ours.config.quantization == {"method": "int4", "group_size": 32, "symmetric": True}
    experts = ours.model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.gate_up_proj.dtype == torch.int32
    assert experts.gate_up_proj_scale.dtype == torch.bfloat16  # the scales as shipped
    assert not isinstance(ours.model.layers[1].self_attn.o_proj, QuantLinear)  # not quantized in the checkpoint
    assert_matches_hf(ours, hf)


def test_a_weight_without_its_scale_fails_by_name(tmp_path):
    _, path = _ship(tmp_path, "deepseek_v3", _fp8, lambda k: k == "model.layers.2.self_attn.o_proj.weight", FP8_CONFIG)
    for shard in path.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors.pop("model.layers.2.self_attn.o_proj.weight_scale_inv", None)
        save_file(tensors, shard)
    with pytest.raises(EyasError, match=r"o_proj\.weight but not model\.layers\.2\.self_attn\.o_proj\.weight_scale"):
        load_model(path, "fp32", "cpu")


def _int4_weights(**changes):
    weights = {**INT4_CONFIG["config_groups"]["group_0"]["weights"], **changes}
    return {**INT4_CONFIG, "config_groups": {"g": {"weights": weights}}}


def _hf(qcfg):
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "quantization_config": qcfg}


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "awq", "bits": 4}, "unsupported quantization 'awq'"),
    ({"quant_method": "fp8"}, "must be block-quantized"),
    (_int4_weights(num_bits=8), "only int4 group or channel"),
    (_int4_weights(actorder="group"), "without activation ordering"),
])
def test_unsupported_quantization_is_refused_at_config(qcfg, message):
    with pytest.raises(EyasError, match=message):
        ModelConfig.from_hf(_hf(qcfg))


def test_asymmetric_and_channel_int4_schemes_are_read():
    got = ModelConfig.from_hf(_hf(_int4_weights(symmetric=False, group_size=128))).quantization
    assert got == {"method": "int4", "group_size": 128, "symmetric": False}
    got = ModelConfig.from_hf(_hf(_int4_weights(strategy="channel", group_size=None))).quantization
    assert got == {"method": "int4", "group_size": 0, "symmetric": True}
