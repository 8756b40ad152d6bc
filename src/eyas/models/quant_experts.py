"""Routed experts whose weights stay in their shipped format (int4 pack-quantized or FP8 blocks).

The experts hold almost all of a DeepSeek-V3 / Kimi-K2 model's bytes, so they are what must stay packed. The
stacked layout is that of models/moe.Experts, each tensor quantized per expert (eyas.layers.quant_linear has
the formats): `gate_up_proj` [E, 2I, *] and `down_proj` [E, H, *] hold the stored values, `*_scale` (and
`*_zero_point` for asymmetric int4) their scales. Under tensor parallelism each rank keeps a slice of every
expert's intermediate dimension, as the dense experts do.

Three paths give the same sums. The reference (CPU, and the definition): each expert that some token chose
dequantized in turn to the activations' dtype and run on every token, bit for bit the dense experts'
reference on the dequantized weights (whose other experts add only zeros). On CUDA at decode (at most MAX_COPIES token copies), one Triton launch per projection computes every
(token, chosen expert) row straight from the packed weights, with no data-dependent shapes (CUDA graphs
capture it). Larger CUDA batches (prefill) dequantize one expert at a time for the rows routed to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.tensor_parallel import TPContext
from eyas.kernels import enabled
from eyas.layers.quant_linear import QuantFormat, check_logical_shape, copy_piece, span, take
from eyas.models.moe import experts_reference

MAX_COPIES = 256  # token copies (tokens x experts per token) up to which CUDA runs the kernel


class QuantExperts(nn.Module):
    quantized = True

    def __init__(self, fmt: QuantFormat, num_experts: int, hidden: int, intermediate: int, tp: TPContext,
                 scale_dtype: torch.dtype):
        super().__init__()
        self.fmt, self.tp, self.hidden, self.num_experts = fmt, tp, hidden, num_experts
        self.inter_full = intermediate
        self.inter = tp.shard(intermediate, "expert intermediate size")
        self.cols = {"gate_up_proj": hidden, "down_proj": self.inter}
        for name, rows in (("gate_up_proj", 2 * self.inter), ("down_proj", hidden)):
            for suffix, shape in fmt.piece_shapes(rows, self.cols[name]).items():
                dtype = fmt.values_dtype() if suffix == "" else scale_dtype if suffix == "_scale" else torch.int32
                self.register_parameter(name + suffix, nn.Parameter(torch.empty(num_experts, *shape, dtype=dtype),
                                                                    requires_grad=False))
        self.gate_up_proj_zero_point = getattr(self, "gate_up_proj_zero_point", None)
        self.down_proj_zero_point = getattr(self, "down_proj_zero_point", None)

    @classmethod
    def replacing(cls, experts: nn.Module, fmt: QuantFormat, scale_dtype: torch.dtype) -> "QuantExperts":
        e, two_i, h = experts.gate_up_proj.shape
        return cls(fmt, e, h, experts.inter * experts.tp.size, experts.tp, scale_dtype)

    def pieces(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return getattr(self, name), getattr(self, name + "_scale"), getattr(self, name + "_zero_point")

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) dequantized to `dtype`."""
        return tuple(self.fmt.dequantize(*(p[e] if p is not None else None for p in self.pieces(name)),
                                         self.cols[name], dtype) for name in ("gate_up_proj", "down_proj"))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if enabled(x, weights) and ids.numel() <= MAX_COPIES:
            return self.forward_kernel(x, weights, ids)
        if x.is_cuda:
            return self.forward_sorted(x, weights, ids)
        return experts_reference(x, weights, ids, ids.unique().tolist(), lambda e: self.expert(e, x.dtype))

    def forward_kernel(self, x, weights, ids):
        """Every (token, chosen expert) copy as one row of one launch per projection."""
        from eyas.kernels.w4a16 import quant_linear_rows

        N, k = ids.shape
        flat = ids.flatten().to(torch.int32)
        copies = x.repeat_interleave(k, 0)
        h = quant_linear_rows(copies, self.fmt, *self.pieces("gate_up_proj"), expert_ids=flat)
        gate, up = h.chunk(2, dim=-1)
        y = quant_linear_rows(F.silu(gate) * up, self.fmt, *self.pieces("down_proj"), expert_ids=flat)
        return (y.view(N, k, -1).float() * weights[..., None]).sum(1).to(x.dtype)

    def forward_sorted(self, x, weights, ids):
        """Each chosen expert dequantized once, run on the rows routed to it (data-dependent shapes: no graphs)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gate_up, down = self.expert(e, x.dtype)
            gate, up = F.linear(x[rows], gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down)
            out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        return out.to(x.dtype)

    def load(self, param: str, tensor: torch.Tensor, shard=None):
        """param: gate_up_proj / down_proj plus a piece suffix; shard: (expert, 0 gate | 1 up) or expert."""
        name = "gate_up_proj" if param.startswith("gate_up_proj") else "down_proj"
        suffix = param[len(name):]
        if suffix == "_shape":
            want = (self.inter_full, self.hidden) if name == "gate_up_proj" else (self.hidden, self.inter_full)
            return check_logical_shape(tensor, want)
        n, r = self.inter, self.tp.rank
        unit_rows, unit_cols = self.fmt.units(self.inter_full if name == "down_proj" else self.hidden)[suffix]
        if name == "gate_up_proj":
            expert, part = shard
            dst = getattr(self, param).data[expert]
            rows = dst.narrow(-2, *span(part * n, n, unit_rows, dst.shape[-2], param))
            return copy_piece(rows, take(tensor, -2, r * n, n, unit_rows, param), f"expert {expert} {param}")
        per_row = suffix and self.fmt.method == "int4" and not self.fmt.group
        src = tensor if per_row else take(tensor, -1, r * n, n, unit_cols, param)
        copy_piece(getattr(self, param).data[shard], src, f"expert {shard} {param}")
