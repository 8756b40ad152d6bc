"""EAGLE-3's per-position loss term and top-1 guess: sum_v p_v log softmax(z)_v, and argmax z.

Usage: ce, top = soft_cross_entropy(logits, probs)   # logits, probs: [B, T, V]; ce, top: [B, T]

On CUDA (EYAS_KERNELS not "0", or "force" on any device for the tests) a Triton kernel computes both in one
pass over the logits and the teacher, and its own backward (eyas.kernels.soft_ce); elsewhere torch does,
with the same meaning in float32 (the kernel computes p.z - logsumexp(z), equal as the teacher's p sums
to 1).
"""

from __future__ import annotations

import torch

from eyas.kernels import switched_on


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, probs):
        from eyas.kernels.soft_ce import soft_ce_forward

        ce, lse, top = soft_ce_forward(logits, probs)
        ctx.save_for_backward(logits, probs, lse)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad_ce, _grad_top):
        from eyas.kernels.soft_ce import soft_ce_backward

        logits, probs, lse = ctx.saved_tensors
        return soft_ce_backward(logits, probs, lse, grad_ce), None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, T, V] (any float dtype); probs: [B, T, V] float32 teacher distributions. The teacher gets
    no gradient."""
    if switched_on(logits):
        return _SoftCrossEntropy.apply(logits, probs.detach())
    z = logits.float()
    return (probs * torch.log_softmax(z, dim=-1)).sum(-1), z.argmax(-1)
