"""What the fast paths do, decided once: a frozen plan that layers and kernels read instead of the environment.

    from eyas import execution_plan
    execution_plan.current().fused_linear            # what a layer reads, at call time
    with execution_plan.using(fused_linear=False):   # a benchmark or a twin test times or compares the other side
        ...

Each field is one decision about a shipped optimisation; the default plan is what eyas ships. A benchmark
that times an optimisation against its absence installs a changed plan with `using`, captures its graphs
(which keep what the plan said as they were captured) and restores the default when it leaves. Layers read
the plan per call, never cache it, so a graph captured under a changed plan is captured with it.
What an engine derives from the plan for its device and shapes is eyas.engine.plan_summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutionPlan:
    decode_ahead: bool = True      # greedy steps and cycles one ahead of the host (engine/ahead.py)
    fused_linear: bool = True      # decode projections through the fused GEMV kernels, not cuBLAS
    fused_o_proj: bool = True      # a small model's attention output projection through the GEMV tiles
    pdl: bool = True               # programmatic dependent launch on sm_90 and later (kernels/pdl.py)
    merge_in_kernel: bool = True   # split attention merges its partial results inside the attention kernel
    short_row_splits: bool = True  # rows of up to 512 columns split too (False: they attend in one pass)
    topk_kernel: bool = True       # the draft's log-softmax and top-k in one kernel
    draft_fusions: bool = True     # the draft step's fused projections and norms, logits kept instead of fp32
    accept_kernel: bool = True     # a chain's greedy acceptance in one kernel
    tree_kernels: bool = True      # a tree's frontier steps, node selection, acceptance and KV compaction in a
    # kernel each; end to end trees 14-17% faster than with the torch ops (docs/kernels.md).
    qkv_rotary_rows: int = 2       # rows up to which norm, q/k/v, rotary and cache write run as one kernel;
    # 0: never; at or past the kernel's own row limit: wherever it applies. 4-8 rows were 1-3% slower with it.
    persistent_rows: int = 8       # new tokens up to which a one-sequence pass runs as one persistent kernel
    # (engine/persistent.py); 0: never. End to end it won at 1, 4, 6 and 8 rows, level for the widest 8-row
    # tree (docs/kernels.md); 8 is the kernel's limit.
    persistent_skips_fp32: bool = True  # fp32 targets keep eyas's path: the kernel's fp32 step took 1.67x eyas's
    # graphed one on an H100 (docs/kernels.md). False: they take the kernel too, for a check of its fp32 tokens.
    persistent_draft: bool = True  # a one-sequence chain's draft steps as one persistent kernel launch each
    # (engine/persistent_draft.py); end to end chain 5/1/6 3.1% faster, 3/1/4 level (docs/kernels.md).

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = int if f.name in ("qkv_rotary_rows", "persistent_rows") else bool
            if type(value) is not kind or (kind is int and value < 0):
                raise ValueError(f"ExecutionPlan.{f.name} must be a {'non-negative int' if kind is int else 'bool'},"
                                 f" not {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT = ExecutionPlan()
_current = DEFAULT


def current() -> ExecutionPlan:
    """The plan in force in this process now."""
    return _current


@contextlib.contextmanager
def using(**changes) -> Iterator[ExecutionPlan]:
    """Install the current plan with `changes` for the body of the with-block, then restore the one before."""
    global _current
    before = _current
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
