"""A new draft for an MLA target gets ordinary 128-wide heads, not the target's rope-only head_dim."""

from types import SimpleNamespace

import transformers

from eyas.config import ModelConfig
from eyas.train.draft_init import draft_config_for


def test_mla_target_draft_heads():
    hf = transformers.DeepseekV3Config(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                                       num_hidden_layers=6, num_attention_heads=8, n_routed_experts=4, n_group=2,
                                       topk_group=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None,
                                       qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=100)
    target = ModelConfig.from_hf({**hf.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    section = SimpleNamespace(aux_layer_ids=[], draft_vocab_size=64, intermediate_size=None, rope_theta=10000.0)
    draft = draft_config_for(target, section)
    assert target.mla and target.head_dim == 16
    assert (draft.hidden_size, draft.num_heads, draft.num_kv_heads, draft.head_dim) == (256, 2, 2, 128)
