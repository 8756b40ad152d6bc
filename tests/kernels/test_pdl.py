"""Programmatic dependent launch (eyas.kernels.pdl), and the attention kernel's in-kernel split merge.

On the CPU: the decode kernels compile for sm_90 (in a subprocess, outside Triton's interpreter) with one
griddepcontrol.wait then one griddepcontrol.launch_dependents when PDL is on and none when it is off, and only
the fused projections read memory (their weights) before the wait; the merging attention kernel has its
atomics and L2 reads. On a GPU (EYAS_TEST_CUDA=1, sm_90 or later): the engine's greedy tokens with PDL on
equal those with it off, plain, chain and tree, in bf16 and through CUDA graphs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.kernels.pdl import pdl_args, pdl_on
from tests.conftest import on_gpu

SCRIPT = Path(__file__).with_name("pdl_ptx.py")
CUDA = on_gpu()
# The kernels that load weights before the wait: the whole tile, or the first K chunk.
WEIGHT_FIRST = {"norm_linear", "silu_mul_linear", "norm_linear_chunked", "silu_mul_linear_chunked", "norm_qkv_rotary"}


def _ptx_facts(mode: str, *kernels: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, str(SCRIPT), mode, *kernels], capture_output=True, text=True, env=env,
                       timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return {r["kernel"]: r for r in rows}


def test_with_pdl_each_decode_kernel_waits_once_before_its_data_then_signals():
    """One wait, then one signal; only the projections read (their weights) before the wait."""
    facts = _ptx_facts("on")
    assert len(facts) == 22
    for name, f in facts.items():
        assert (f["launch_dependents"], f["wait"], f["signal_after_wait"]) == (1, 1, True), f
        if name in WEIGHT_FIRST:
            assert 0 < f["loads_before_wait"] < f["loads"], f  # weights before, the rows after
        else:
            assert f["loads_before_wait"] == 0, f


def test_without_pdl_no_grid_dependency_instructions():
    facts = _ptx_facts("off", "norm_linear", "slot_attention", "slot_attention_merging")
    for f in facts.values():
        assert (f["launch_dependents"], f["wait"]) == (0, 0), f
    # The in-kernel split merge (the plan's merge_in_kernel): the counter's acq_rel add at GPU scope after a barrier,
    # its reset, and the other programs' partials read from L2; none of it without the merge.
    merging, plain = facts["slot_attention_merging"], facts["slot_attention"]
    assert merging["atomics"] == ["atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32"], merging
    assert merging["cg_loads"] > 0 and merging["bar_sync"] > plain["bar_sync"]
    assert plain["atomics"] == [] and plain["cg_loads"] == 0


def test_pdl_is_on_for_sm90_unless_switched_off_and_never_on_the_cpu(monkeypatch):
    import eyas.kernels.pdl as pdl
    from eyas import execution_plan

    x = torch.zeros(2)
    assert not pdl_on(x)  # a CPU tensor: the interpreter has no grid dependency control
    assert pdl_args(x) == {"USE_PDL": False}  # and no launch_pdl option, which the interpreter would refuse
    cuda = type("FakeCudaTensor", (), {"is_cuda": True, "device": torch.device("cuda", 0)})()
    monkeypatch.setattr(pdl, "_capable", lambda index: True)  # as an sm_90 GPU
    assert pdl_on(cuda)
    with execution_plan.using(pdl=False):
        assert not pdl_on(cuda)
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # an older GPU
    assert not pdl_on(cuda)
    monkeypatch.setattr(pdl, "pdl_on", lambda t: True)
    assert pdl.pdl_args(x) == {"USE_PDL": pdl.ON, "launch_pdl": True}


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("spec", [None, (3, 1), (3, 2, 5)], ids=["plain", "chain", "tree"])
def test_pdl_gives_the_same_tokens_under_cuda_graphs(tmp_path, plan, spec):
    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from tests.helpers import random_draft, tiny_llama

    tiny_llama(tmp_path / "t", vocab=32, layers=3, hidden=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 11)]

    def generate(pdl: bool):
        plan(pdl=pdl)
        torch.manual_seed(0)
        draft = random_draft(128, 32, draft_vocab=24, head_dim=32).requires_grad_(False) if spec else None
        engine = Engine(str(tmp_path / "t"), dtype="bf16", device="cuda", max_batch=2, max_len=128, draft=draft,
                        spec=SpecConfig(*spec, adaptive=False) if spec else None)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 70)]
        return [s.output_ids for s in engine.generate(prompts, params)]

    assert generate(True) == generate(False)
