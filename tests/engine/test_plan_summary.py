"""Engine.execution_plan_summary: the plan in force at build and the paths it implies for the engine's device
and its target's shapes, from the predicates the layers ask."""

import json

import pytest

from eyas import execution_plan
from eyas.engine.engine import Engine
from tests.helpers import tiny_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=32, layers=2, hidden=64)
    return str(path)


def test_a_cpu_engine_runs_no_kernels(target, monkeypatch):
    monkeypatch.delenv("EYAS_KERNELS", raising=False)
    summary = Engine(target, dtype="fp32", device="cpu", max_batch=1, max_len=32).execution_plan_summary
    assert json.loads(json.dumps(summary)) == summary  # JSON as it is, for /server_info and the ledger
    assert summary["plan"] == execution_plan.DEFAULT.to_dict()
    assert not summary["kernels"] and not summary["pdl"] and not summary["cuda_graphs"] and not summary["run_ahead"]
    assert summary["qkv_rotary_rows"] == 0 and not summary["attention"]["kernel"]
    assert set(summary["projections"]) == {"qkv", "o_proj", "gate_up", "down"}
    assert all(path == "torch" for rows in summary["projections"].values() for path in rows.values())


def test_forced_kernels_fuse_the_decode_projections_unless_the_plan_says_no(target, monkeypatch):
    monkeypatch.setenv("EYAS_KERNELS", "force")
    summary = Engine(target, dtype="fp32", device="cpu", max_batch=1, max_len=32).execution_plan_summary
    assert summary["kernels"] and not summary["pdl"]  # PDL needs an sm_90 GPU
    assert summary["qkv_rotary_rows"] == 2 and summary["attention"]["merge_in_kernel"]
    assert summary["persistent_rows"] == 0  # an fp32 target keeps eyas's path: the kernel is slower there
    with execution_plan.using(persistent_skips_fp32=False):
        fp32_kernel = Engine(target, dtype="fp32", device="cpu", max_batch=1, max_len=32).execution_plan_summary
    assert fp32_kernel["persistent_rows"] == execution_plan.DEFAULT.persistent_rows > 0
    assert {name: rows["1"] for name, rows in summary["projections"].items()} == dict.fromkeys(
        ("qkv", "o_proj", "gate_up", "down"), "fused")
    with execution_plan.using(fused_linear=False, fused_o_proj=False, qkv_rotary_rows=0, merge_in_kernel=False):
        ablated = Engine(target, dtype="fp32", device="cpu", max_batch=1, max_len=32).execution_plan_summary
    assert not ablated["plan"]["fused_linear"] and ablated["qkv_rotary_rows"] == 0
    assert not ablated["attention"]["merge_in_kernel"]
    assert all(path == "torch" for rows in ablated["projections"].values() for path in rows.values())
