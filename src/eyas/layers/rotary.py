"""Rotary position embedding (rotate-half convention) with linear, llama3 and yarn frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from eyas.kernels import enabled, enabled_with_grad


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn(inv, head_dim, theta, scaling)
    return inv


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolate the slow dimensions by `factor`, keep the fast ones, ramp linearly in between."""
    factor = scaling["factor"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    old_ctx = scaling["original_max_position_embeddings"]

    def dim_for(rotations):  # the dimension that turns `rotations` times over the pretraining context
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(fast), dim_for(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """YaRN scales cos/sin (so q.k by its square) to keep attention entropy at long context; 1 otherwise."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:  # DeepSeek: the rest of the scaling goes into the softmax scale (see mla.py)
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


class _RotaryFunction(torch.autograd.Function):
    """RotaryEmbedding.forward with a gradient, in the rotary kernel both ways: the rotation is linear, and its
    transpose is the rotation by the opposite angle, so the backward is the same kernel with -sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions):
        from eyas.kernels.rotary import apply_rotary

        ctx.save_for_backward(cos, sin, positions)
        return apply_rotary(q, k, cos, sin, positions)

    @staticmethod
    def backward(ctx, dq, dk):
        from eyas.kernels.rotary import apply_rotary

        cos, sin, positions = ctx.saved_tensors
        dq, dk = apply_rotary(dq, dk, cos, -sin, positions)
        return dq, dk, None, None, None


def _training_kernel(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The kernel with a backward: when a gradient is wanted, on CUDA unless EYAS_KERNELS is "0" ("force": any
    device, for the tests), for q and k of one dtype."""
    return enabled_with_grad(q, k) and q.dtype == k.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by position; tables are rebuilt by `reset_buffers`."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_positions = head_dim, theta, scaling, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    def reset_buffers(self):
        inv = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(self.cos.device)
        t = torch.arange(self.max_positions, device=inv.device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(self.scaling)
        # Re-registered rather than copied into, so the tables stay fp32 whatever dtype the model was cast to.
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q, k: [B, T, heads, D]; positions: [B, T]. One fused kernel on CUDA, with a backward in training."""
        if enabled(q, k):
            from eyas.kernels.rotary import apply_rotary

            return apply_rotary(q, k, self.cos, self.sin, positions)
        if _training_kernel(q, k):
            return _RotaryFunction.apply(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].to(q.dtype).unsqueeze(2)
        sin = self.sin[positions].to(q.dtype).unsqueeze(2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
