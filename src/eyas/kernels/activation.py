"""SiLU-and-multiply for the gated MLP, in one kernel.

The reference, `gate, up = gate_up.chunk(2, dim=-1); F.silu(gate) * up`, launches two kernels and writes
the SiLU result out in between; at batch 1 the launch is the cost. Rounding follows torch: silu(gate) =
gate / (1 + exp(-gate)) in fp32 with an IEEE division, rounded to the input dtype, then the product computed
in fp32 and rounded once more. Triton's exp on a GPU is the fast approximate one, a few fp32 ulps from
torch's, so there a rare bf16 element can round the other way (off by one ulp of silu, times up); the
rounding recipe itself is torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous
from eyas.kernels.rounding import rounded

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, row_stride, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * row_stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = rounded(tl.div_rn(g, 1.0 + tl.exp(-g)), gate.dtype)  # IEEE division, as torch's
    out = rounded(silu * up.to(tl.float32), gate.dtype)
    tl.store(out_ptr + row * inter + cols, out.to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate, up = gate_up.chunk(2, dim=-1); gate_up [..., 2I] with rows at any stride
    (the last dim is made contiguous if it is not). Returns a new contiguous [..., I] tensor."""
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"silu_mul computes in fp32 and supports fp32, bf16 and fp16, not {gate_up.dtype}")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"the last dim of gate_up {tuple(gate_up.shape)} must be even (gate then up)")
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    pdl = pdl_args(rows)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, _BLOCK))](
        rows, out, rows.stride(0), inter, BLOCK=_BLOCK, num_warps=4, **pdl)
    return out
