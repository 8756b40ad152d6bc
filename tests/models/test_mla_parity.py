"""DeepSeek-V3 / Kimi-K2 (latent attention + grouped-routing MoE) equal HF transformers (fp32, 1e-4), through
the latent cache: one shared key/value head of width kv_lora_rank + qk_rope_head_dim."""

import json
import math

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from eyas.config import ModelConfig
from eyas.dist.launch import free_port
from eyas.tensor_parallel import TPContext
from eyas.engine.runner import ModelRunner
from eyas.errors import EyasError
from eyas.layers.rotary import attention_factor
from eyas.models.llama import CausalLM
from eyas.models.loader import load_model
from eyas.models.mla import softmax_scale
from eyas.models.moe import SparseMoE
from tests.models.tiny_moe import assert_matches_hf, save_tiny
from tests.models.tp_ranks import logits, tp_worker


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3-full-q", "kimi_k2"])
def test_logits_match_hf_prefill_and_appends(name, tmp_path):
    hf = save_tiny(name, tmp_path)
    ours = load_model(tmp_path, "fp32", "cpu")
    cfg = ours.config
    assert cfg.family == ("kimi_k2" if name == "kimi_k2" else "deepseek_v3")
    assert cfg.moe_layers == [1, 2, 3] and not isinstance(ours.model.layers[0].mlp, SparseMoE)
    assert_matches_hf(ours, hf)


def test_cache_holds_one_latent_per_token(tmp_path):
    save_tiny("deepseek_v3", tmp_path)
    runner = ModelRunner(load_model(tmp_path, "fp32", "cpu"), num_slots=2, max_len=64, device="cpu")
    assert runner.kv.k.shape == (4, 3, 1, 64, 32 + 8) and runner.kv.v is runner.kv.k
    assert runner.kv.bytes() == runner.kv.k.numel() * 4


def test_yarn_tables_match_hf(tmp_path):
    """cos/sin carry YaRN's frequencies and attention factor exactly as transformers computes them."""
    hf = save_tiny("deepseek_v3", tmp_path)
    ours = load_model(tmp_path, "fp32", "cpu")
    pos = torch.arange(200)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    assert torch.allclose(ours.model.rotary.cos[:200], cos[0], atol=1e-5)
    assert torch.allclose(ours.model.rotary.sin[:200], sin[0], atol=1e-5)
    assert hf.model.rotary_emb.attention_scaling != 1.0  # mscale != mscale_all_dim, so the factor is exercised


def test_mtp_layer_is_skipped_and_other_strays_are_not(tmp_path):
    """DeepSeek-V3 ships its multi-token-prediction layer as model.layers.<L>; that one is ignored, others fail."""
    save_tiny("deepseek_v3", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {k.replace("layers.3.", "layers.4."): v.clone() for k, v in weights.items() if ".layers.3." in k}
    save_file({**weights, **mtp}, tmp_path / "model.safetensors")
    load_model(tmp_path, "fp32", "cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(EyasError, match="unexpected weight 'model.layers.4"):
        load_model(tmp_path, "fp32", "cpu")


def test_tp2_equals_tp1(tmp_path):
    """Two gloo ranks: heads, kv_b_proj, every expert's and the shared expert's intermediate dim split in two."""
    save_tiny("deepseek_v3", tmp_path)
    port = free_port()
    mp.spawn(tp_worker, args=(port, str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    want = logits(load_model(tmp_path, "fp32", "cpu"))
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


DEEPSEEK_V3_CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json, the fields we read
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_full_size_deepseek_v3_config_and_tp8_shapes():
    cfg = ModelConfig.from_hf(DEEPSEEK_V3_CONFIG)
    assert cfg.moe_layers == list(range(3, 61)) and cfg.mtp_layers == 1
    assert cfg.quantization == {"method": "fp8", "block": [128, 128]}
    assert cfg.kv_cache_layout(8) == (1, 512 + 64, True)  # 1152 bytes a token a layer in bf16, on every rank
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert attention_factor(cfg.rope_scaling) == 1.0
    with torch.device("meta"):
        layer = CausalLM(cfg, TPContext(rank=3, size=8), max_positions=4096).model.layers[3]
    assert layer.self_attn.heads == 16 and layer.self_attn.kv_b_proj.weight.shape == (16 * 256, 512)
    assert layer.mlp.experts.gate_up_proj.shape == (256, 2 * 256, 7168)
    assert layer.mlp.shared_experts.down_proj.weight.shape == (7168, 256)
