"""RMSNorm, computed in fp32 and cast back exactly as the reference implementation does.

On CUDA at inference the same math runs as one fused Triton kernel (eyas.kernels.norm), and
`residual` fuses the residual add that precedes a norm into it.
"""

import torch
from torch import nn

from eyas.kernels import enabled


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if enabled(x, self.weight):
            from eyas.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
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
