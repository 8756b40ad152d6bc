"""A benchmark's ablation: execution-plan fields (eyas.execution_plan) set from their text while engines are
built and run (CUDA graphs keep what they captured under them).

    with ablated("fused_linear", "0"):            # execution_plan.using(fused_linear=False)
        engine = Engine(...)
    with ablated("pdl", "0", "topk_kernel", "0"):  # several fields together
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses

from eyas import execution_plan

FIELDS = {f.name: f for f in dataclasses.fields(execution_plan.ExecutionPlan)}


def plan_value(name: str, text: str):
    """The plan field `name`'s value from its text: 0/1 (or false/true) for a decision, a count for
    qkv_rotary_rows and persistent_rows; a bad one is a one-line SystemExit."""
    if isinstance(getattr(execution_plan.DEFAULT, name), bool):
        if text.lower() in ("0", "false", "off"):
            return False
        if text.lower() in ("1", "true", "on"):
            return True
    elif text.isdigit():
        return int(text)
    kind = isinstance(getattr(execution_plan.DEFAULT, name), bool)
    raise SystemExit(f"{name}={text!r}: expected {'0 or 1' if kind else 'a row count'}")


def plan_changes(pairs: dict[str, str]) -> dict:
    """{field: text} -> execution_plan.using's keywords; a name that is no plan field is a one-line SystemExit."""
    unknown = sorted(set(pairs) - set(FIELDS))
    if unknown:
        raise SystemExit(f"not execution plan fields: {', '.join(unknown)} (fields: {', '.join(FIELDS)})")
    return {k: plan_value(k, v) for k, v in pairs.items()}


@contextlib.contextmanager
def ablated(name: str, value: str, *more: str):
    """name = value (and more name, value pairs) inside the block, through execution_plan.using."""
    pairs = dict(zip((name, *more[::2]), (value, *more[1::2])))
    with execution_plan.using(**plan_changes(pairs)):
        yield
