"""The frozen target's side of training: fused features, final hidden states, embeddings and logits.

Usage: feats = run_target(target, ids)           # online: the whole target, in-process, per batch
       heads = TargetHeads.load("demo", device)  # offline: only the embedding and the LM head

Offline training stores the target's *final hidden state* next to the fused features and recomputes
the logits with the LM head, rather than storing logits restricted to the draft vocabulary: per token
that is H values (576 for SmolLM2, 4096 for Llama-3-8B) instead of draft_vocab_size (8192..32000),
several times less disk, and the exact logits the online path computes from the same hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from eyas.config import ModelConfig
from eyas.layers.kv_cache import KVCache
from eyas.errors import EyasError
from eyas.layers.attention import AttentionBatch
from eyas.models.llama import CausalLM
from eyas.models.loader import safetensors_files


@dataclass
class TargetOutput:
    features: torch.Tensor  # [B, T, 3H] residual streams entering the captured layers
    hidden: torch.Tensor    # [B, T, H] after the final norm


@torch.no_grad()
def run_target(target: CausalLM, input_ids: torch.Tensor) -> TargetOutput:
    """A full causal forward over right-padded rows (padding sits after every real token, so no real
    token attends to it). The KV cache is scratch space sized to this batch."""
    cfg = target.config
    B, T = input_ids.shape
    dtype = next(target.parameters()).dtype
    heads, head_dim, shared = cfg.kv_cache_layout(target.tp.size)  # MLA targets cache one shared latent
    kv = KVCache(cfg.num_layers, B, T, heads, head_dim, dtype, input_ids.device, shared=shared)
    batch = AttentionBatch(kv=kv, slots=torch.arange(B, device=input_ids.device),
                           starts=torch.zeros(B, dtype=torch.long, device=input_ids.device), kv_len=T)
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    out = target(input_ids, positions, batch)
    if out.aux_hidden is None:
        raise EyasError("the target captured no features: set target.capture_layers first")
    return TargetOutput(out.aux_hidden, out.hidden)


class TargetHeads(torch.nn.Module):
    """The target's embedding and LM head alone, read straight from its checkpoint (offline training
    needs nothing else of the target, so a large target never has to fit beside the draft)."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 norm: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.register_buffer("embed_weight", embed)
        self.register_buffer("lm_head_weight", lm_head)
        self.norm_weight = norm  # the final RMSNorm's weight, where the checkpoint has one (draft head init)

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, device) -> "TargetHeads":
        from eyas.models.demo import resolve_model_path  # "demo" -> its converted directory

        path = resolve_model_path(str(path))
        cfg = ModelConfig.from_dir(path)
        found = {}
        for f in safetensors_files(path):
            with safe_open(str(f), framework="pt") as fh:
                for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
                    if key in fh.keys():
                        found[key] = fh.get_tensor(key)
        if "model.embed_tokens.weight" not in found:
            raise EyasError(f"{path} has no model.embed_tokens.weight")
        head = found.get("lm_head.weight")
        if head is None:
            if not cfg.tie_word_embeddings:
                raise EyasError(f"{path} has no lm_head.weight and does not tie it to the embedding")
            head = found["model.embed_tokens.weight"]
        norm = found.get("model.norm.weight")
        return cls(cfg, found["model.embed_tokens.weight"].to(device, dtype), head.to(device, dtype),
                   None if norm is None else norm.to(device, dtype))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's output, in the weights' dtype (the teacher casts only the draft vocabulary's columns)."""
        return F.linear(hidden, self.lm_head_weight)
