"""SiLU-and-mul, the gated MLP's activation: silu(gate) * up over a fused [..., 2I] gate_up projection."""

import torch
import torch.nn.functional as F

from eyas.kernels import enabled


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if enabled(gate_up):
        from eyas.kernels.activation import silu_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
