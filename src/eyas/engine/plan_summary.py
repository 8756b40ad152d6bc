"""What an engine will do, said once at build: the execution plan and the paths it implies for this engine's
device and its target's layer shapes (eyas.execution_plan).

    summary = plan_summary(engine)  # JSON-able; logged at start, in /server_info and the ledger

Every derived entry comes from the predicate the layer itself asks at run time (kernels.enabled, pdl_on,
fused_linear.projection_paths, qkv_rotary.max_rows, ahead.may_run_ahead), called on an empty probe tensor of
the engine's device and dtype shaped as a step of that many rows: the summary cannot disagree with the layers
about the plan in force when it was built.
"""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.engine.ahead import may_run_ahead
from eyas.kernels import enabled
from eyas.layers.fused_linear import projection_paths

ROWS = (1, 2, 4, 8)  # a decode step of one or two sequences; a verify of up to 8 rows


@torch.inference_mode()  # as the engine runs: the kernels take no tensor that wants a gradient
def plan_summary(engine) -> dict:
    """The plan in force and what it means for `engine`: kernels, PDL, CUDA graphs, running ahead of the host,
    and per projection of the target's first layer which path a step of 1, 2, 4 and 8 rows takes."""
    plan = execution_plan.current()

    def probe_of(rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), device=engine.device, dtype=engine.dtype)

    kernels = enabled(probe_of(1, 1))
    pdl, qkv_rotary_rows = False, 0
    if kernels:  # the kernel modules import Triton, which a CPU install may lack
        from eyas.kernels.pdl import pdl_on
        from eyas.layers.qkv_rotary import max_rows

        pdl, qkv_rotary_rows = pdl_on(probe_of(1, 1)), max_rows()
    layers = engine.target.model.layers
    other = "cublas" if engine.device.type == "cuda" else "torch"
    return {
        "plan": plan.to_dict(),
        "device": str(engine.device),
        "kernels": kernels,
        "pdl": pdl,
        "cuda_graphs": engine.runner.graphs is not None,
        "run_ahead": may_run_ahead(engine, []),
        "projections": projection_paths(layers[0], probe_of, ROWS, other) if len(layers) else {},
        "qkv_rotary_rows": qkv_rotary_rows,
        # a one-sequence pass of up to this many new tokens runs as one persistent kernel (engine/persistent.py)
        "persistent_rows": plan.persistent_rows if engine.runner.persistent.eligible else 0,
        # a one-sequence chain's draft steps run as one persistent kernel each (engine/persistent_draft.py)
        "persistent_draft": persistent_draft(engine, plan),
        "attention": {"kernel": kernels, "merge_in_kernel": kernels and plan.merge_in_kernel,
                      "short_row_splits": kernels and plan.short_row_splits},
    }


def persistent_draft(engine, plan) -> bool:
    """Whether this engine's chain draft steps may run as persistent launches: the plan asks and its draft
    qualifies (engine/persistent_draft.py)."""
    persistent = engine.decoder.drafter.persistent if engine.decoder is not None else None
    return bool(plan.persistent_draft and persistent is not None and persistent.eligible)
