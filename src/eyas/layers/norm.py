"""RMSNorm, computed in fp32 and cast back exactly as the reference implementation does.

On CUDA at inference the same math runs as one fused Triton kernel (eyas.kernels.norm), and
`residual` fuses the residual add that precedes a norm into it; in training, a kernel pair with a backward.
"""

import torch
from torch import nn

from eyas.kernels import enabled, enabled_with_grad


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm.forward with a gradient, as two Triton kernels (eyas.kernels.norm): training runs each of the
    draft's norms on every TTT step, and torch's version is about eight elementwise kernels forward and
    more backward over [tokens, hidden] float32 tensors."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from eyas.kernels.norm import rms_norm_train

        x = x.contiguous()
        y, rstd = rms_norm_train(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        from eyas.kernels.norm import rms_norm_backward

        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(x, weight, rstd, dy.contiguous())
        return dx, dw, None


def _training_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel pair with a backward: when a gradient is wanted, on CUDA unless EYAS_KERNELS is "0"
    ("force": any device, for the tests)."""
    return (enabled_with_grad(x, weight) and x.shape[-1] <= 65536
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.dtype == torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if enabled(x, self.weight):
            from eyas.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if _training_kernel(x, self.weight):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def residual(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm after it; with delta None, (x, norm(x))."""
        if delta is None:
            return x, self(x)
        if enabled(x, delta, self.weight):
            from eyas.kernels.norm import add_rms_norm

            return add_rms_norm(x, delta, self.weight, self.eps)
        h = x + delta
        return h, self(h)


def rms_norm_pair(norm_a: RMSNorm, a: torch.Tensor, norm_b: RMSNorm, b: torch.Tensor) -> torch.Tensor:
    """torch.cat([norm_a(a), norm_b(b)], -1): one kernel at inference (eyas.kernels.norm.rms_norm_pair) when both
    norms share eps and a and b their shape and dtype."""
    if (enabled(a, b, norm_a.weight, norm_b.weight) and norm_a.eps == norm_b.eps and a.shape == b.shape
            and a.dtype == b.dtype and norm_a.weight.dtype == norm_b.weight.dtype and a.shape[-1] <= 65536):
        from eyas.kernels.norm import rms_norm_pair as fused

        return fused(a, norm_a.weight, b, norm_b.weight, norm_a.eps)
    return torch.cat([norm_a(a), norm_b(b)], dim=-1)
