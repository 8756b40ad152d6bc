"""A projection together with the norm or activation before it, as one kernel at decode (eyas.kernels.fused_linear).

The torch meaning of each function is its fallback, written out below: the residual add and RMSNorm
(`RMSNorm.residual`) then the linear; SiLU-and-mul then the linear. The fused kernel runs when the kernels
are enabled for these tensors (CUDA, no autograd), there are at most MAX_ROWS tokens (decode steps of one or
two sequences: verify passes and prefills keep cuBLAS; projections of at most NARROW_N outputs up to
NARROW_ROWS) of at most MAX_K features (small models, where launches dominate; large ones keep cuBLAS),
everything shares one dtype, and the execution plan's fused_linear is on (benchmarks turn it off to measure
the fusion).
The target's layers take column- and row-parallel linears; the EAGLE-3 draft's steps (models/eagle3.py) take
plain weights through `linear_rows` and `add_silu_mul_linear` (the residual add after its MLP in the down
projection's kernel), and `norm_linear` / `silu_mul_linear` through eagle3.FusedLinear.
"""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.kernels import enabled
from eyas.layers.activation import silu_mul
from eyas.layers.linear import dense
from eyas.layers.norm import RMSNorm


def fused_kernel_fits(x: torch.Tensor, features: int, *tensors: torch.Tensor | None,
                      outputs: int | None = None) -> bool:
    """Whether the kernel takes x, whose projection reads `features` inputs per row (for SiLU-and-mul, half
    of x's width: gate_up holds gate and up side by side). A projection that names its `outputs` may take
    up to NARROW_ROWS rows (MAX_ROWS if more) when they are at most NARROW_N, else up to MAX_ROWS."""
    present = [t for t in tensors if t is not None]
    if not enabled(x, *present):  # first: the kernel module imports Triton, which a CPU install may lack
        return False
    from eyas.kernels.fused_linear import MAX_K, MAX_ROWS, NARROW_N, NARROW_ROWS

    rows = max(MAX_ROWS, NARROW_ROWS) if outputs is not None and outputs <= NARROW_N else MAX_ROWS
    return (execution_plan.current().fused_linear and features <= MAX_K
            and x.numel() <= rows * x.shape[-1] and enabled(x, *present)
            and all(t.dtype == x.dtype for t in present))


def norm_linear(norm: RMSNorm, linear, h: torch.Tensor,
                delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, linear(norm(h + delta))); with delta None, (h, linear(norm(h))). `linear` is a
    column-parallel linear (weight [N, K], optional bias): its output needs no all-reduce."""
    if fused_kernel_fits(h, h.shape[-1], delta, norm.weight, linear.weight, linear.bias,
                         outputs=linear.weight.shape[0]):
        from eyas.kernels.fused_linear import norm_linear as fused

        return fused(h, delta, norm.weight, norm.eps, linear.weight, linear.bias)
    h, x = norm.residual(h, delta)
    return h, _project(linear, x)


def project_rows(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for a row-parallel `linear` (the attention's output projection): up to MAX_K features (small
    models) through the kernels' decode GEMV tiles, which launch under PDL while attention finishes
    (the plan's fused_o_proj=False: cuBLAS); otherwise cuBLAS."""
    if project_rows_fused(linear, x):
        from eyas.kernels.fused_linear import linear_rows

        return linear.finish(linear_rows(x, linear.weight))
    return linear(x)


def project_rows_fused(linear, x: torch.Tensor) -> bool:
    """Whether project_rows takes the GEMV tiles for x."""
    return execution_plan.current().fused_o_proj and fused_kernel_fits(x, x.shape[-1], linear.weight,
                                                                        outputs=linear.weight.shape[0])


def silu_mul_linear(linear, gate_up: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) for a row-parallel `linear` (its all-reduce and bias applied after)."""
    if fused_kernel_fits(gate_up, gate_up.shape[-1] // 2, linear.weight):
        from eyas.kernels.fused_linear import silu_mul_linear as fused

        return linear.finish(fused(gate_up, linear.weight))
    return linear(silu_mul(gate_up))


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for a plain weight (the EAGLE-3 draft's fused q/k/v), through the kernels' tiles
    at decode, where the draft's steps are launch-bound; otherwise cuBLAS."""
    if fused_kernel_fits(x, x.shape[-1], weight, outputs=weight.shape[0]):
        from eyas.kernels.fused_linear import linear_rows as fused

        return fused(x, weight)
    return dense(x, weight)


def add_silu_mul_linear(residual: torch.Tensor, weight: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """residual + F.linear(silu(gate) * up, weight) for a plain weight (the EAGLE-3 draft's MLP and the residual
    add after it), the add inside the kernel at decode."""
    if fused_kernel_fits(gate_up, gate_up.shape[-1] // 2, weight, residual):
        from eyas.kernels.fused_linear import silu_mul_linear as fused

        return fused(gate_up, weight, residual)
    return residual + dense(silu_mul(gate_up), weight)


def projection_paths(layer, probe_of, rows: tuple[int, ...], other: str) -> dict:
    """Per projection of a llama-shaped decoder layer (models/llama.py), for each row count (as a string, JSON's
    key): "fused" where a step of that many rows takes the kernels, asked as the functions above ask, else
    `other` (cuBLAS on CUDA, torch's matmul elsewhere). probe_of(rows, width) makes an empty input of the
    engine's device and dtype (engine/plan_summary.py reports these paths)."""
    attn, mlp = layer.self_attn, layer.mlp
    paths: dict[str, dict[str, str]] = {}

    def add(name, fits):
        paths[name] = {str(n): "fused" if fits(n) else other for n in rows}

    if hasattr(attn, "qkv_proj"):
        w = attn.qkv_proj.weight
        add("qkv", lambda r: fused_kernel_fits(probe_of(r, w.shape[1]), w.shape[1], layer.input_layernorm.weight, w,
                                               attn.qkv_proj.bias, outputs=w.shape[0]))
    if hasattr(attn, "o_proj"):
        add("o_proj", lambda r: project_rows_fused(attn.o_proj, probe_of(r, attn.o_proj.weight.shape[1])))
    if hasattr(mlp, "gate_up_proj"):
        w = mlp.gate_up_proj.weight
        add("gate_up", lambda r: fused_kernel_fits(probe_of(r, w.shape[1]), w.shape[1],
                                                   layer.post_attention_layernorm.weight, w, outputs=w.shape[0]))
    if hasattr(mlp, "down_proj"):
        w = mlp.down_proj.weight
        add("down", lambda r: fused_kernel_fits(probe_of(r, 2 * w.shape[1]), w.shape[1], w))
    return paths


def _project(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x); torch's own nn.Linear (the EAGLE-3 draft's head) through layers.linear.dense, as ours are."""
    if isinstance(linear, torch.nn.Linear):
        return dense(x, linear.weight, linear.bias)
    return linear(x)
