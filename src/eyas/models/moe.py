"""Sparse mixture-of-experts MLP: a router picks top-k experts per token, their outputs are mixed by weight.

Routing comes in two kinds. `softmax` (Mixtral, Qwen3-MoE): top-k of the softmax probabilities, optionally
renormalized. `sigmoid` (DeepSeek-V3, Kimi-K2): sigmoid scores plus a learned per-expert bias choose the
experts, restricted to the `topk_group` groups whose two best biased scores sum highest; the mixing weights
are the unbiased scores, optionally renormalized, times `routed_scaling_factor`.

Experts run on one of two paths that give the same result: a plain loop over experts (the reference: every
expert on every token, weighted by the router's weight for it, zero where not chosen) and a grouped path
that sorts token copies by expert and runs one grouped matmul per projection (bf16 on CUDA, where
`F.grouped_mm` has its kernel). Neither has data-dependent shapes, so CUDA graphs can capture either; the
reference does num_experts/k times the needed work and serves CPU and non-bf16 GPU runs.

Under tensor parallelism every rank holds a slice of each expert's intermediate dimension, exactly like a
dense MLP, and the routed experts' partial sums are all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import ModelConfig
from eyas.tensor_parallel import TPContext
from eyas.layers.linear import copy_weight

# Public from torch 2.10; older releases have only the private op, the oldest neither (then: the reference path).
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class Router(nn.Module):
    """Scores experts in fp32 whatever the model dtype (as the reference keeps its gate): near-tied experts
    must rank the same way they did in training."""

    keep_fp32 = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.scoring, self.norm = cfg.num_experts_per_tok, cfg.scoring, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        logits = F.linear(x.float(), self.weight.float())
        if self.scoring == "softmax":
            weights, ids = logits.softmax(-1).topk(self.top_k, dim=-1)
            if self.norm:
                weights = weights / weights.sum(-1, keepdim=True)
            return weights, ids
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        groups = biased.view(x.shape[0], self.n_group, -1)
        best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        biased = groups.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Experts(nn.Module):
    """All experts' SwiGLU weights as two stacked tensors: gate_up [E, 2I, H] and down [E, H, I] (I per rank)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.inter = tp.shard(intermediate, "expert intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, self.inter))
        self.grouped: bool | None = None  # None: grouped for bf16 on CUDA, the reference loop elsewhere

    def load(self, param: str, tensor: torch.Tensor, shard=None):
        """shard: (expert, 0 | 1) for one expert's gate / up, expert for its down, None for the stacked tensor."""
        n, r = self.inter, self.tp.rank
        if shard is None:  # transformers 5's in-memory layout: all experts at once, gate then up
            if param == "gate_up_proj":
                half = tensor.shape[1] // 2
                tensor = torch.cat([tensor[:, r * n:(r + 1) * n], tensor[:, half + r * n:half + (r + 1) * n]], 1)
            else:
                tensor = tensor[:, :, r * n:(r + 1) * n]
            return copy_weight(getattr(self, param).data, tensor, param)
        if param == "gate_up_proj":
            expert, part = shard
            return copy_weight(self.gate_up_proj.data[expert, part * n:(part + 1) * n], tensor.narrow(0, r * n, n),
                               f"expert {expert} {'up' if part else 'gate'}")
        copy_weight(self.down_proj.data[shard], tensor.narrow(1, r * n, n), f"expert {shard} down")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        grouped = self.grouped
        if grouped is None:
            grouped = x.is_cuda and x.dtype == torch.bfloat16 and GROUPED_MM is not None
        return (self.forward_grouped if grouped else self.forward_reference)(x, weights, ids)

    def forward_reference(self, x, weights, ids):
        return experts_reference(x, weights, ids, range(self.gate_up_proj.shape[0]),
                                 lambda e: (self.gate_up_proj[e], self.down_proj[e]))

    def forward_grouped(self, x, weights, ids):
        """Token copies sorted by expert, one grouped matmul per projection; shapes depend only on N and k."""
        N, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        ends = torch.searchsorted(flat[order], torch.arange(self.gate_up_proj.shape[0], device=x.device),
                                  right=True).to(torch.int32)
        h = GROUPED_MM(x[order // k], self.gate_up_proj.transpose(1, 2), offs=ends)
        gate, up = h.chunk(2, dim=-1)
        y = GROUPED_MM(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        # Un-sort into [N, k, H] and sum over k: a fixed order, so no atomics and the same result every run.
        per_copy = torch.empty_like(y).index_copy_(0, order, y)
        return (per_copy.view(N, k, -1).float() * weights[..., None]).sum(1).to(x.dtype)


def experts_reference(x, weights, ids, experts, expert) -> torch.Tensor:
    """x: [N, H]; weights, ids: [N, k]; expert(e) -> (gate_up [2I, H], down [H, I]) in x's dtype. The definition:
    sum over experts e of weight(token, e) * e(token), each expert in `experts` run on every token. Leaving out
    experts no token chose changes no bit (their terms are zeros), but needs the ids on the host."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts:
        gate_up, down = expert(e)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down)
        out += y.float() * (weights * (ids == e)).sum(-1, keepdim=True)
    return out.to(x.dtype)


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared experts that every token uses, DeepSeek-style)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, shared: nn.Module | None = None):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        out = self.tp.all_reduce(self.experts(flat, weights, ids)).view(x.shape)
        return out + self.shared_experts(x) if self.shared_experts is not None else out

