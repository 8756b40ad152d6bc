"""eyas.execution_plan: the default plan is what eyas ships, `using` changes it for a block and restores it,
bad values are refused, and the layers read the plan in force when they run."""

import pytest
import torch

from eyas import execution_plan
from eyas.execution_plan import ExecutionPlan


def test_the_default_plan_turns_every_optimisation_on():
    plan = execution_plan.current()
    assert plan == execution_plan.DEFAULT == ExecutionPlan()
    assert all(v is True for k, v in plan.to_dict().items() if k not in ("qkv_rotary_rows", "persistent_rows"))
    assert plan.qkv_rotary_rows == 2 and plan.persistent_rows == 8


def test_using_changes_the_plan_for_its_block_and_restores_it():
    before = execution_plan.current()
    with execution_plan.using(pdl=False) as outer:
        assert execution_plan.current() is outer and not outer.pdl and outer.fused_linear
        with execution_plan.using(fused_linear=False, qkv_rotary_rows=0):
            now = execution_plan.current()
            assert not now.pdl and not now.fused_linear and now.qkv_rotary_rows == 0
        assert execution_plan.current() is outer
    assert execution_plan.current() is before
    with pytest.raises(RuntimeError), execution_plan.using(topk_kernel=False):
        raise RuntimeError("the block fails")
    assert execution_plan.current() is before


def test_a_plan_is_frozen_and_typed():
    with pytest.raises(Exception):
        execution_plan.current().pdl = False
    for bad in (dict(pdl=0), dict(pdl="0"), dict(qkv_rotary_rows=-1), dict(qkv_rotary_rows=True)):
        with pytest.raises(ValueError, match="ExecutionPlan"):
            ExecutionPlan(**bad)
    with pytest.raises(TypeError):
        with execution_plan.using(no_such_field=True):
            pass


def test_a_layer_reads_the_plan_when_it_runs(monkeypatch):
    """topk with the plan's topk_kernel off takes torch's path though the kernels may run."""
    import eyas.kernels.topk as kernels
    from eyas.layers import topk as layer

    monkeypatch.setenv("EYAS_KERNELS", "force")
    calls = []
    monkeypatch.setattr(kernels, "topk", lambda *a: calls.append(1) or torch.topk(a[0], a[1]))
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    with execution_plan.using(topk_kernel=False):
        values, indices = layer.topk(x, 2)
    assert not calls and torch.equal(indices, x.topk(2, dim=-1).indices)
    layer.topk(x, 2)
    assert calls == [1]
