"""The EAGLE-3 draft head: fc over fused target features, one decoder layer, norm, reduced-vocab lm_head.

Module names are the checkpoints' own (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), so the
SGLang layout loads by identity. The embedding is the target's, passed in as token embeddings.

The layer's attention is Llama's (`LlamaForCausalLMEagle3`) or, when the config has `kv_lora_rank`, DeepSeek's
multi-head latent attention (`Eagle3DeepseekV2ForCausalLM`, SGLang's and vLLM's `deepseek_eagle3.py`, SpecForge's
`DeepseekV3ForCausalLMEagle3`): the same midlayer, whose q_a_proj (or q_proj) and kv_a_proj_with_mqa read the
2H-wide input; q_a_layernorm, q_b_proj, kv_a_layernorm, kv_b_proj and o_proj are DeepSeek-V3's, with no biases.
Both attentions expose `project` (rotated q, k, v) and `output`, so training (train/ttt.py) runs the same weights.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas import execution_plan
from eyas.tensor_parallel import SINGLE
from eyas.draft_config import DraftConfig
from eyas.kernels import enabled
from eyas.layers.attention import AttentionBatch, rotate_and_attend
from eyas.layers.fused_linear import add_silu_mul_linear, linear_rows, norm_linear, silu_mul_linear
from eyas.layers.linear import dense
from eyas.layers.norm import RMSNorm, rms_norm_pair
from eyas.layers.rotary import RotaryEmbedding
from eyas.models.mla import MLAttention


def step_fusions() -> bool:
    """Whether a drafting step runs its fc and o projections through the fused GEMV tiles, its two input norms
    as one kernel and the residual add inside the down projection's kernel (each falls back to torch's ops
    where the kernels do not apply), and whether the draft's state keeps its head's logits rather than fp32
    log-probs (engine.drafter.Drafter.scores). The execution plan's draft_fusions=False keeps the
    separate ops. Read as the step is traced, so a captured graph keeps it."""
    return execution_plan.current().draft_fusions


def fuse_linears(owner: nn.Module, linears: list[nn.Linear], name: str):
    """Concatenate the linears' weights into one non-persistent buffer `name` of `owner`, and make each
    linear's weight a view into it: one matmul instead of several at inference, checkpoints keep the
    separate EAGLE-3 weights, and load_state_dict (which copies into the views) updates the fused one."""
    fused = torch.cat([m.weight.detach() for m in linears])
    owner.register_buffer(name, fused, persistent=False)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[row: row + n], requires_grad=False)
        row += n


@dataclass(frozen=True)
class FusedLinear:
    """A bias-free linear over a draft weight, as the fused layers take a linear (`weight`, `bias`, a call, and
    `finish`, which has no all-reduce to do here). Built per call: moving the module or changing its dtype
    replaces the weight."""

    weight: torch.Tensor
    bias: None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y


class DraftAttention(nn.Module):
    """Attention whose q/k/v read the 2H-wide [norm(embedding), norm(hidden)] input."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.scale = d ** -0.5
        self.register_buffer("qkv_weight", None, persistent=False)  # set by fuse_projections() for inference

    def fuse_projections(self):
        fuse_linears(self, [self.q_proj, self.k_proj, self.v_proj], "qkv_weight")

    def qkv(self, x):
        """q [B, T, heads, D], k and v [B, T, kv_heads, D], before the rotary embedding."""
        B, T, _ = x.shape
        d = self.head_dim
        if self.qkv_weight is not None:
            q, k, v = linear_rows(x, self.qkv_weight).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(B, T, self.heads, d), k.view(B, T, self.kv_heads, d), v.view(B, T, self.kv_heads, d)

    def project(self, x, positions, rotary):
        q, k, v = self.qkv(x)
        q, k = rotary(q, k, positions)
        return q, k, v

    def output(self, out):
        return linear_rows(out, self.o_proj.weight) if step_fusions() else self.o_proj(out)

    def forward(self, x, positions, batch: AttentionBatch, rotary):
        return self.output(rotate_and_attend(*self.qkv(x), positions, rotary, 0, batch, self.scale))


class DraftMLAttention(MLAttention):
    """The target's latent attention (models/mla.py, weight-absorbed, one cached latent per token) reading 2H."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg, 0, SINGLE, in_features=2 * cfg.hidden_size)
        # The target's parallel linears are allocated for loading; a new draft needs nn.Linear's default init.
        for m in (self.kv_b_proj, self.o_proj, getattr(self, "q_b_proj", None), getattr(self, "q_proj", None)):
            if m is not None:
                nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse_projections()

    def fuse_projections(self):
        fuse_linears(self, [self.gate_proj, self.up_proj], "gate_up_weight")

    def forward(self, x):
        if self.gate_up_weight is not None:
            return self.down(F.linear(x, self.gate_up_weight))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def down(self, gate_up, residual=None):
        """The MLP from its fused gate/up projection's output on: activation and down projection, one kernel at
        decode; with `residual`, residual + that, the add in the same kernel."""
        if residual is not None:
            return add_silu_mul_linear(residual, self.down_proj.weight, gate_up)
        return silu_mul_linear(FusedLinear(self.down_proj.weight), gate_up)


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftMLAttention(cfg) if cfg.mla else DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, positions, batch, rotary):
        fusions = step_fusions()
        if self.norm_before_residual or not fusions:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = hidden, rms_norm_pair(self.input_layernorm, embeds, self.hidden_norm, hidden)
        out = self.self_attn(x, positions, batch, rotary)
        if self.mlp.gate_up_weight is None:  # unfused (training): the separate gate and up projections
            h, x = self.post_attention_layernorm.residual(residual, out)
            return h + self.mlp(x)
        # Inference: the residual add and the norm inside the gate/up projection's kernel at decode, and the
        # add after the MLP inside the down projection's.
        h, gate_up = norm_linear(self.post_attention_layernorm, FusedLinear(self.mlp.gate_up_weight), residual, out)
        return self.mlp.down(gate_up, h) if fusions else h + self.mlp.down(gate_up)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # speculators/vLLM variants (checkpoint keys `input_norm.weight`, `fc_norm.{i}.weight`): RMSNorm over the
        # fused features, or over each of the three, before fc.
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      max_positions or max(cfg.max_position_embeddings, 2048))

    def forward(self, embeds, hidden, positions, batch: AttentionBatch, fuse: bool = False) -> torch.Tensor:
        """embeds, hidden: [B, T, H] (hidden is [B, T, 3*Ht] target features when `fuse`). Returns the step's
        output, which is both the next step's hidden input and the input of `logits`: the pre-norm state, or with
        `norm_output` the normalised one."""
        batch.prepare(embeds.shape[1])
        if fuse:
            hidden = self.fuse_features(hidden)
        return self.step_output(self.midlayer(embeds.to(hidden.dtype), hidden, positions, batch, self.rotary))

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the target's [B, T, 3*Ht] features (after the optional input norms): the first hidden input."""
        x = features.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        return linear_rows(x, self.fc.weight) if step_fusions() else self.fc(x)

    def step_output(self, h: torch.Tensor) -> torch.Tensor:
        """What the decoder layer's output `h` becomes for the next step and the head: itself, or with
        `norm_output` (speculators' "Eagle 3.1") its final-normed value, which the head then reads as is."""
        return self.norm(h) if self.config.norm_output else h

    def fuse_projections(self) -> "Eagle3Draft":
        """Inference only: fused q/k/v and gate/up matmuls (the draft step is launch-bound at small batch)."""
        for m in (self.midlayer.self_attn, self.midlayer.mlp):
            if hasattr(m, "fuse_projections"):
                m.fuse_projections()
        return self

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (fp32)."""
        return self.head_output(out).float()

    def head_output(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary in the head's dtype (autocast's, in training). At decode the norm
        runs inside the lm_head's kernel; with gradients (training) norm_linear keeps torch's ops. With
        `norm_output` the step's output is already normed."""
        if self.config.norm_output:
            return linear_rows(out, self.lm_head.weight) if step_fusions() else self.lm_head(out)
        return norm_linear(self.norm, self.lm_head, out, None)[1]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed_ids(self, draft_ids: torch.Tensor, embedding: nn.Module) -> torch.Tensor:
        """The target's embeddings of draft-vocabulary ids; `embedding` is the target's (vocab-parallel)
        embedding. One kernel at inference on one rank (eyas.kernels.draft_embed), else to_target_ids and the
        lookup."""
        if step_fusions() and embedding.tp.size == 1 and enabled(embedding.weight, self.d2t):
            from eyas.kernels.draft_embed import draft_embed

            return draft_embed(draft_ids, self.d2t, embedding.weight)
        return embedding(self.to_target_ids(draft_ids))
