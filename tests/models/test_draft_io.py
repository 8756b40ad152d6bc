"""Draft checkpoints: every layout round-trips to identical logits; official EAGLE files load; misfits are refused."""

import json

import pytest
import torch
from safetensors import safe_open

from eyas.config import ModelConfig
from eyas.draft_config import DraftConfig
from eyas.layers.kv_cache import KVCache
from eyas.errors import EyasError
from eyas.layers.attention import AttentionBatch
from eyas.models.draft_io import load_draft, save_draft
from tests.helpers import random_draft

H, V = 64, 96


@torch.no_grad()  # a loaded draft is frozen, a new one is not: autograd may pick other CPU kernels
def draft_logits(draft, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(1, 5, H, generator=g)
    feats = torch.randn(1, 5, 3 * H, generator=g)
    kv = KVCache(1, 1, 16, draft.config.num_kv_heads, draft.config.head_dim, torch.float32, "cpu")
    batch = AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([0]), kv_len=16)
    return draft.logits(draft(emb, feats, torch.arange(5)[None], batch, fuse=True))


def target_cfg(hidden=H, vocab=V):
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("layout", ["sglang", "eagle", "speculators"])
def test_layouts_round_trip_to_identical_logits(tmp_path, layout):
    draft = random_draft(H, V, draft_vocab=40)
    draft.config.aux_layer_ids = [1, 2, 3]
    save_draft(draft, tmp_path / layout, layout=layout, dtype=torch.float32, speculative_tokens=4)
    back = load_draft(tmp_path / layout, target_cfg())
    assert back.config.layout == layout
    assert back.config.capture_layers(6) == (2, 3, 4)  # explicit ids kept with SGLang's meaning across layouts
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)
    assert torch.equal(draft_logits(back), draft_logits(draft))
    cfg = json.loads((tmp_path / layout / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" or cfg["transformer_layer_config"]["torch_dtype"] == "float32"
    if layout == "eagle":  # the official loader reads pytorch_model.bin first (tests/models/test_eagle_official_rules.py)
        assert cfg["architectures"] == ["LlamaForCausalLM"] and "target_hidden_size" not in cfg
        assert not (tmp_path / layout / "model.safetensors").exists()
        return
    with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers' loaders check it when present
    if layout == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    if layout == "speculators":
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4] and cfg["norm_before_residual"] is False
        assert cfg["norm_output"] is False and cfg["norm_before_fc"] is False and cfg["fc_norm"] is False
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert back.config.speculative_tokens == 4


def test_official_eagle_checkpoint_loads(tmp_path):
    """EAGLE's own files: LlamaForCausalLM, no rope_theta (so 10000), pytorch_model.bin, no embed in the weights."""
    draft = random_draft(H, V, draft_vocab=40)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "vocab_size": V, "draft_vocab_size": 40, "tie_word_embeddings": False,
           "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.save(draft.state_dict(), tmp_path / "pytorch_model.bin")
    back = load_draft(tmp_path, target_cfg())
    assert back.config.layout == "eagle" and back.config.rope_theta == 10000.0 and back.config.head_dim == 16
    assert torch.equal(draft_logits(back), draft_logits(draft))


def test_draft_that_does_not_fit_is_refused(tmp_path):
    save_draft(random_draft(H, V, draft_vocab=40), tmp_path / "d")
    with pytest.raises(EyasError, match="hidden size"):
        load_draft(tmp_path / "d", target_cfg(hidden=128))
    with pytest.raises(EyasError, match="vocabulary"):
        load_draft(tmp_path / "d", target_cfg(vocab=128))


def test_draft_config_validation():
    with pytest.raises(EyasError, match="draft_vocab_size"):
        DraftConfig(hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10,
                    draft_vocab_size=20, target_hidden_size=8)


def test_fused_projections_give_the_same_logits_and_follow_loaded_weights():
    """Inference fuses q/k/v and gate/up into one matmul each; the output is unchanged, checkpoints keep the
    separate weights, and weights loaded afterwards (training-time evaluation reloads every eval) reach the
    fused matmul."""
    from eyas.layers.kv_cache import KVCache
    from eyas.layers.attention import AttentionBatch
    from tests.helpers import random_draft

    def run(d):
        kv = KVCache(1, 2, 16, d.config.num_kv_heads, d.config.head_dim, torch.float32, "cpu")
        batch = AttentionBatch(kv=kv, slots=torch.arange(2), starts=torch.zeros(2, dtype=torch.long), kv_len=16)
        g = torch.Generator().manual_seed(1)
        embeds, hidden = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 96, generator=g)
        return d.logits(d(embeds, hidden, torch.arange(5).expand(2, 5), batch, fuse=True))

    plain, other = random_draft(32, 64, 48, seed=0).eval(), random_draft(32, 64, 48, seed=1).eval()
    keys = set(plain.state_dict())
    expected = run(plain)
    with torch.no_grad():
        plain.fuse_projections()
        assert set(plain.state_dict()) == keys
        assert torch.allclose(run(plain), expected, atol=1e-5)
        plain.load_state_dict(other.state_dict())
        assert torch.allclose(run(plain), run(other), atol=1e-5)
