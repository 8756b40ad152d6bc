"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), computed in the weight-absorbed form.

Keys and values of every head are linear images of one small per-token latent: k_nope_h = W_UK_h c and
v_h = W_UV_h c, with c = norm(kv_a(x)) of width kv_lora_rank, plus one rotary key part k_rope shared by all
heads. So the cache holds only [c, k_rope] per token (one "head" of width kv_lora_rank + qk_rope_head_dim,
used as both key and value) and attention runs in latent space: the query's no-rope part is mapped through
W_UK_h (q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c), the attention output (a mix of latents) through
W_UV_h. The rope columns ride along in the value and are dropped afterwards, so the plain `attend` over the
slot cache, tree masks included, serves MLA unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.tensor_parallel import TPContext
from eyas.layers.attention import AttentionBatch, attend
from eyas.layers.linear import ColumnParallelLinear, RowParallelLinear
from eyas.layers.norm import RMSNorm
from eyas.layers.quant_linear import dense_weight
from eyas.layers.rotary import RotaryEmbedding, yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 when the config sets mscale_all_dim."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): rotating interleaved pairs equals rotate-half on this
    order, and queries and keys share it, so dot products are unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    """`in_features` is the input width: hidden_size in the target, 2 * hidden_size in an EAGLE-3 draft, whose
    down-projections read [norm(embedding), norm(hidden)] (models/eagle3.py passes its DraftConfig as `cfg`)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, in_features: int | None = None):
        super().__init__()
        self.layer = layer
        self.heads = tp.shard(cfg.num_heads, "attention heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        h, qk = cfg.hidden_size, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        x = in_features or h
        # The down-projections are small and feed every head: each rank keeps them whole (plain linears).
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(x, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [cfg.num_heads * qk], False, tp)
        else:
            self.q_proj = ColumnParallelLinear(x, [cfg.num_heads * qk], False, tp)
        self.kv_a_proj_with_mqa = nn.Linear(x, self.rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # Only its weight is used (absorbed into q and the output); heads are split across ranks.
        self.kv_b_proj = ColumnParallelLinear(self.rank, [cfg.num_heads * (self.nope + self.v_dim)], False, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, h, cfg.attention_bias, tp)
        self.low_rank_q = bool(cfg.q_lora_rank)

    def _absorbed(self, dtype: torch.dtype):
        """(W_UK, W_UV): kv_b_proj's weight per head, [heads, nope, rank] and [heads, v_dim, rank] (dequantized
        here when the checkpoint ships it quantized: it is small, and absorbed rather than applied)."""
        return dense_weight(self.kv_b_proj, dtype).view(self.heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)

    def project(self, x, positions, rotary: RotaryEmbedding):
        """Latent-space (q, k, v): q [B, T, heads, rank + rope]; k = v = [B, T, 1, rank + rope]."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent, k_rope = self.kv_a_layernorm(latent)[:, :, None], k_rope[:, :, None]
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = rotary(q_rope, k_rope, positions)
        q_latent = torch.einsum("bthn,hnr->bthr", q_nope, self._absorbed(q_nope.dtype)[0])
        kv = torch.cat([latent, k_rope], dim=-1)  # key and value alike
        return torch.cat([q_latent, q_rope], dim=-1), kv, kv

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out: [B, T, heads * (rank + rope)], attention over the latents; the rope columns are dropped."""
        B, T, _ = out.shape
        out = out.view(B, T, self.heads, self.rank + self.rope)[..., :self.rank]
        return self.o_proj(torch.einsum("bthr,hvr->bthv", out, self._absorbed(out.dtype)[1]).flatten(2))

    def forward(self, x, positions, batch: AttentionBatch, rotary: RotaryEmbedding):
        return self.output(attend(*self.project(x, positions, rotary), self.layer, batch, self.scale))
