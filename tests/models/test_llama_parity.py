"""Our decoder equals HF transformers (fp32, 1e-4) for prefill and incremental appends, per architecture."""

import pytest
import torch
import transformers

from eyas.engine.runner import ModelRunner
from eyas.models.loader import load_model

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)

CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
    "llama2-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=24),
}
ARCH = {"llama3": "LlamaForCausalLM", "llama2-tied": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def save_tiny(name, tmp_path, seed=0):
    torch.manual_seed(seed)
    cfg = CONFIGS[name]()
    hf = getattr(transformers, ARCH[name])(cfg).eval()
    with torch.no_grad():  # random biases, so a dropped qkv bias would show
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf_prefill_and_appends(name, tmp_path):
    hf = save_tiny(name, tmp_path)
    ours = load_model(tmp_path, "fp32", "cpu")
    runner = ModelRunner(ours, num_slots=2, max_len=256, device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (1, 40), generator=g)
    # prefill 20, then 8 appends of sizes 1,1,3,1,2,1,1,1 (several-token appends included); use slot 1
    chunks = [20, 1, 1, 3, 1, 2, 1, 1, 1]
    start = 0
    for n in chunks:
        piece = ids[:, start:start + n]
        pos = torch.arange(start, start + n)[None]
        out = runner.forward(piece, pos, [1], [start])
        got = ours.logits(out.hidden)
        with torch.no_grad():
            want = hf(ids[:, :start + n]).logits[:, start:start + n]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), f"{name}: max diff {(got - want).abs().max():.2e} at {start}"
        start += n
