"""Tiny random MoE and MLA checkpoints built with transformers' own classes, and the HF-parity check.

Weights are redrawn at unit scale (HF's 0.02 init leaves attention near-uniform and routing near-tied, where
a wrong softmax scale or router would hide under the tolerance), and the routers are drawn wide so expert
choices are far from ties.
"""

from __future__ import annotations

import json

import torch
import transformers

from eyas.engine.runner import ModelRunner

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
            eos_token_id=None, bos_token_id=None)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
DEEPSEEK = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**TINY, intermediate_size=32, num_key_value_heads=2,
                                                  num_local_experts=8, num_experts_per_tok=2),
    # A dense layer among sparse ones, un-renormalized top-k, and (generic) YaRN rope.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32,
                                                     num_key_value_heads=2, head_dim=24, num_experts=8,
                                                     num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False,
                                                     rope_parameters=YARN),
    # DeepSeek-V3 as shipped: low-rank q, interleaved rope, YaRN with mscale != mscale_all_dim (both scalings show).
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**TINY, **DEEPSEEK, q_lora_rank=32, rope_parameters=dict(
        YARN, mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)),
    # The V2-Lite shape: full-rank q, rotate-half rope, plain rope.
    "deepseek_v3-full-q": lambda: transformers.DeepseekV3Config(**TINY, **DEEPSEEK, q_lora_rank=None,
                                                                rope_interleave=False),
    # Kimi-K2: one expert group; its config.json says model_type kimi_k2 (rewritten after saving).
    "kimi_k2": lambda: transformers.DeepseekV3Config(**TINY, **dict(DEEPSEEK, n_group=1, topk_group=1), q_lora_rank=32,
                                                     rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0)),
}
CLASSES = {"mixtral": transformers.MixtralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}


def build_hf(name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = CONFIGS[name]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    hf = CLASSES.get(name, transformers.DeepseekV3ForCausalLM)(cfg).eval()
    with torch.no_grad():
        for n, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "rotary" in n:
                continue
            if n.endswith("gate.weight"):
                p.normal_(0, 1)
            elif n.endswith("e_score_correction_bias"):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif n.endswith("weight"):
                p.normal_(1, 0.2)
    return hf


def save_tiny(name: str, path, seed: int = 0, **overrides):
    hf = build_hf(name, seed, **overrides)
    hf.save_pretrained(path)
    if name == "kimi_k2":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    return hf


def assert_matches_hf(model, hf, vocab: int = TINY["vocab_size"], atol: float = 1e-4):
    """Prefill 20 tokens into slot 1, then appends of 1, 1, 3, 1, 2 tokens; logits equal HF's full recompute."""
    runner = ModelRunner(model, num_slots=2, max_len=256, device="cpu")
    ids = torch.randint(0, vocab, (1, 28), generator=torch.Generator().manual_seed(1))
    start = 0
    for n in (20, 1, 1, 3, 1, 2):
        out = runner.forward(ids[:, start:start + n], torch.arange(start, start + n)[None], [1], [start])
        got = model.logits(out.hidden)
        with torch.no_grad():
            want = hf(ids[:, :start + n]).logits[:, start:start + n]
        diff = (got - want).abs().max().item()
        assert diff <= atol, f"max diff {diff:.2e} at position {start}"
        start += n
