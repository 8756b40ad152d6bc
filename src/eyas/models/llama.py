"""The target decoder: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), and with sparse MLPs
(models/moe.py) and latent attention (models/mla.py) Mixtral, Qwen3-MoE, DeepSeek-V3 and Kimi-K2: one implementation.

Only math lives here. Per-forward metadata arrives in an AttentionBatch. For EAGLE-3 the model
returns, as a named value, the residual stream entering the layers listed in `capture_layers`,
concatenated low-mid-high.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.tensor_parallel import SINGLE, TPContext
from eyas.layers.activation import silu_mul
from eyas.layers.attention import AttentionBatch, rotate_and_attend
from eyas.layers.fused_linear import norm_linear, project_rows, silu_mul_linear
from eyas.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from eyas.layers.norm import RMSNorm
from eyas.layers.qkv_rotary import norm_qkv_attend
from eyas.layers.rotary import RotaryEmbedding
from eyas.models.mla import MLAttention
from eyas.models.moe import SparseMoE


@dataclass
class ModelOutput:
    hidden: torch.Tensor              # [B, T, H] after the final norm
    aux_hidden: torch.Tensor | None   # [B, T, len(capture_layers) * H], the EAGLE-3 features


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext):
        super().__init__()
        self.layer = layer
        self.heads = tp.shard(cfg.num_heads, "attention heads")
        self.kv_heads = tp.shard(cfg.num_kv_heads, "key/value heads")
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d,
                                                               "v": cfg.num_kv_heads * d}, cfg.attention_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, positions, batch: AttentionBatch, rotary: RotaryEmbedding):
        return self.attend(self.qkv_proj(x), positions, batch, rotary)

    def attend(self, qkv, positions, batch: AttentionBatch, rotary: RotaryEmbedding):
        """Attention and the output projection, from the fused q/k/v projection's output."""
        B, T, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(B, T, self.heads, d), k.view(B, T, self.kv_heads, d), v.view(B, T, self.kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return project_rows(self.o_proj, rotate_and_attend(q, k, v, positions, rotary, self.layer, batch, d ** -0.5))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter] * 2, False, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def down(self, gate_up):
        """The MLP from its gate/up projection's output on: activation and down projection, one kernel at decode."""
        return silu_mul_linear(self.down_proj, gate_up)


def make_mlp(cfg: ModelConfig, layer: int, tp: TPContext) -> nn.Module:
    if layer not in cfg.moe_layers:
        return MLP(cfg, tp)
    shared = MLP(cfg, tp, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
    return SparseMoE(cfg, tp, shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (MLAttention if cfg.mla else Attention)(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer, tp)

    def forward(self, h, delta, positions, batch, rotary):
        """The residual stream entering this layer is h + delta (the previous layer's MLP output, not yet
        added; None at layer 0). Returns (that stream, the stream after attention, the MLP's output): each
        add happens in the kernel of the norm after it, and for dense layers in the kernel of the projection
        after that norm too (eyas.layers.fused_linear), so a decode step launches two kernels fewer per add."""
        attn, mlp = self.self_attn, self.mlp
        if isinstance(attn, Attention):
            h, out = norm_qkv_attend(attn, self.input_layernorm, h, delta, positions, batch, rotary)
        else:
            h, x = self.input_layernorm.residual(h, delta)
            out = attn(x, positions, batch, rotary)
        if isinstance(mlp, MLP):
            mid, gate_up = norm_linear(self.post_attention_layernorm, mlp.gate_up_proj, h, out)
            return h, mid, mlp.down(gate_up)
        mid, x = self.post_attention_layernorm.residual(h, out)
        return h, mid, mlp(x)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)


class CausalLM(nn.Module):
    """Decoder + LM head. HF parameter names are kept (with fused qkv_proj / gate_up_proj)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext = SINGLE, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = Decoder(cfg, tp, max_positions or cfg.max_position_embeddings)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.capture_layers: tuple[int, ...] = ()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, batch: AttentionBatch) -> ModelOutput:
        batch.prepare(input_ids.shape[1])
        h, delta = self.embed(input_ids), None
        captured = {}
        for i, layer in enumerate(self.model.layers):
            entering, h, delta = layer(h, delta, positions, batch, self.model.rotary)
            if i in self.capture_layers:
                captured[i] = entering
        h, x = self.model.norm.residual(h, delta)
        # Small models can list one layer twice (L=5 gives 2, 2, 2): index, don't filter.
        aux = torch.cat([captured[i] for i in self.capture_layers], dim=-1) if self.capture_layers else None
        return ModelOutput(x, aux)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
