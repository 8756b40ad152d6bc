"""L2 prefetches of the next projection's weight (eyas.kernels.l2_prefetch, eyas.layers.prefetch).

On the CPU: the two kernels compile for sm_90 (in a subprocess, outside Triton's interpreter) to their PTX
prefetch instructions, the settings are parsed or refused, and nothing prefetches off a GPU. On a GPU
(EYAS_TEST_CUDA=1, sm_90 or later): the engine's greedy tokens with prefetching equal those without, through
CUDA graphs, plain and chain."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.kernels.l2_prefetch import chunks, prefetch_l2
from eyas.layers import prefetch

CUDA = os.environ.get("EYAS_TEST_CUDA") == "1" and torch.cuda.is_available()
PTX_SCRIPT = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from eyas.kernels import l2_prefetch as m
for name, kern, cx, warps in [("bulk", m._bulk_kernel, dict(CHUNK=32768, PER_PROGRAM=32), 1),
                              ("lines", m._lines_kernel, dict(LINES_PER_PROGRAM=1024), 4)]:
    sig = dict({"base_ptr": "*u8", "nbytes": "i64", "scratch_ptr": "*i32"}, **{k: "constexpr" for k in cx})
    ptx = triton.compile(ASTSource(kern, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps}).asm["ptx"]
    ops = [line.split()[0] for line in ptx.splitlines() if re.match(r"\\s*(cp\\.async|prefetch\\.|ld\\.global)", line)]
    print(json.dumps({"kernel": name, "ops": ops}))
"""


def test_the_kernels_compile_to_prefetches_that_read_nothing_back():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-c", PTX_SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-2000:]
    ops = {r["kernel"]: r["ops"] for r in map(json.loads, filter(None, p.stdout.splitlines()))}
    assert ops["bulk"] == ["cp.async.bulk.prefetch.L2.global"]  # one chunk per thread (32 per warp)
    assert ops["lines"] == ["prefetch.global.L2::evict_last"] * 8  # 1,024 lines over 128 threads


def test_chunks_cover_the_bytes_and_refuse_sizes_the_copy_engine_cannot_take():
    assert chunks(32768, 32768) == 1 and chunks(32769, 32768) == 2 and chunks(16, 128) == 1
    for bad in (0, -16, 100):
        with pytest.raises(ValueError, match="multiple of 16"):
            chunks(1024, bad)


def test_settings_are_parsed_or_refused(monkeypatch):
    monkeypatch.delenv("EYAS_L2_PREFETCH", raising=False)
    assert prefetch.mode() is None
    monkeypatch.setenv("EYAS_L2_PREFETCH", "lines")
    assert prefetch.mode() == "lines"
    monkeypatch.setenv("EYAS_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="use 0, bulk or lines"):
        prefetch.mode()
    monkeypatch.setenv("EYAS_L2_PREFETCH_GATE_UP_MB", "1.5")
    assert prefetch.megabytes("EYAS_L2_PREFETCH_GATE_UP_MB") == 3 * 2 ** 19
    for bad in ("lots", "-1"):
        monkeypatch.setenv("EYAS_L2_PREFETCH_GATE_UP_MB", bad)
        with pytest.raises(ValueError, match="EYAS_L2_PREFETCH_GATE_UP_MB"):
            prefetch.megabytes("EYAS_L2_PREFETCH_GATE_UP_MB")
    with pytest.raises(ValueError, match="mode"):
        prefetch_l2(torch.zeros(16), mode="all")


def test_nothing_prefetches_off_a_gpu_and_a_join_without_forks_is_free(monkeypatch):
    monkeypatch.setenv("EYAS_L2_PREFETCH", "bulk")
    x = torch.zeros(1, 1, 64)
    assert not prefetch.applies(x)
    prefetch.ahead(torch.zeros(64, 64), x)  # returns without touching CUDA
    prefetch.join(x)


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("spec", [None, (3, 1)], ids=["plain", "chain"])
def test_prefetching_gives_the_same_tokens_under_cuda_graphs(tmp_path, monkeypatch, spec):
    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from tests.helpers import random_draft, tiny_llama

    tiny_llama(tmp_path / "t", vocab=32, layers=3, hidden=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 11)]

    def generate(setting: str):
        monkeypatch.setenv("EYAS_L2_PREFETCH", setting)
        monkeypatch.setenv("EYAS_L2_PREFETCH_GATE_UP_MB", "0.01" if setting != "0" else "0")
        torch.manual_seed(0)
        draft = random_draft(128, 32, draft_vocab=24, head_dim=32).requires_grad_(False) if spec else None
        engine = Engine(str(tmp_path / "t"), dtype="bf16", device="cuda", max_batch=2, max_len=128, draft=draft,
                        spec=SpecConfig(*spec) if spec else None)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 70)]
        return [s.output_ids for s in engine.generate(prompts, params)]

    reference = generate("0")
    assert generate("bulk") == reference
    assert generate("lines") == reference
