"""A decode-shaped layer's attention from its residual stream, with the input norm, the q/k/v projection, the
rotary embedding and the KV-cache write in one kernel (eyas.kernels.qkv_rotary) where it applies, instead of
norm_linear then rotate_and_store: one launch fewer per layer.

By default it runs up to two rows (a decode step of one or two sequences, a verify of two tokens): there it
makes SmolLM2's step shorter (docs/kernels.md), but a verify of 4-8 rows longer: each program recomputes the
rows' norm and rotates its pairs, work that grows with the rows. The execution plan's qkv_rotary_rows sets the
row count (0: never; the kernel's own limit or more: wherever it applies). It applies where both kernels it
replaces would run: the fused
projection's conditions (eyas.layers.fused_linear: kernels enabled, a narrow projection of few rows and at
most MAX_K input features) and the slot-attention kernel's, with no q/k norm between projection and rotary
and the rotary not inside the attention kernel.
"""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.kernels import enabled
from eyas.layers.attention import AttentionBatch, attend_cached, rotary_in_attention_at, slot_kernel_fits
from eyas.layers.fused_linear import fused_kernel_fits, norm_linear, project_rows


def max_rows() -> int:
    """Rows (batch x tokens) up to which the layer takes the kernel: the execution plan's qkv_rotary_rows, at
    most the kernel's own limit. Read per call, so a benchmark can time both in one process."""
    from eyas.kernels.fused_linear import KERNEL_ROWS

    return min(execution_plan.current().qkv_rotary_rows, KERNEL_ROWS)


def fused(attn, h: torch.Tensor, delta: torch.Tensor | None, norm, batch: AttentionBatch) -> bool:
    """Whether norm_qkv_attend runs the one kernel for this layer and batch (read as a graph is captured)."""
    if not enabled(h):  # first: the kernel module imports Triton, which a CPU install may lack
        return False
    from eyas.kernels.fused_linear import MAX_K

    w = attn.qkv_proj.weight
    return (h.numel() <= max_rows() * h.shape[-1] and not attn.qk_norm and h.shape[-1] <= MAX_K
            and not rotary_in_attention_at(attn.heads * attn.head_dim)
            and fused_kernel_fits(h, h.shape[-1], delta, norm.weight, w, attn.qkv_proj.bias, outputs=w.shape[0])
            and slot_kernel_fits(h, batch) and h.dtype == batch.kv.k.dtype)


def norm_qkv_attend(attn, norm, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                    batch: AttentionBatch, rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, the attention block's output) for a models.llama.Attention `attn` whose input norm is
    `norm`: through eyas.kernels.qkv_rotary where `fused` says so, else norm_linear and attn.attend."""
    if not fused(attn, h, delta, norm, batch):
        h, qkv = norm_linear(norm, attn.qkv_proj, h, delta)
        return h, attn.attend(qkv, positions, batch, rotary)
    from eyas.kernels.qkv_rotary import norm_qkv_rotary

    h, q = norm_qkv_rotary(h, delta, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.heads,
                           attn.kv_heads, rotary.cos, rotary.sin, positions, batch.kv.k[attn.layer],
                           batch.kv.v[attn.layer], batch.slots, batch.write_pos)
    return h, project_rows(attn.o_proj, attend_cached(q, attn.layer, batch, attn.head_dim ** -0.5))
