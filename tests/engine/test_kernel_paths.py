"""The engine with every Triton kernel on (EYAS_KERNELS=force runs them on the CPU through Triton's
interpreter): the same greedy tokens as the torch reference paths, plain and speculative, chain and tree.

On a GPU (EYAS_TEST_CUDA=1) the same test runs the compiled kernels in bf16 against the reference."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.conftest import on_gpu
from tests.helpers import random_draft, tiny_llama

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]' brings it)")

CUDA = on_gpu()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=32, layers=3, hidden=64)
    return str(path)


@pytest.fixture(scope="module")
def wide_target_dir(tmp_path_factory):
    """Head dim 32: wide enough for the slot-attention kernels (the target above, head dim 16, is not)."""
    path = tmp_path_factory.mktemp("tiny-wide")
    tiny_llama(path, vocab=32, layers=3, hidden=128)
    return str(path)


@pytest.fixture(autouse=True)
def per_op_kernels(plan):
    """These tests are about today's per-op kernels: one-sequence passes and chain draft steps do not go through
    the persistent kernel (execution_plan's persistent_rows and persistent_draft; its own tests are
    test_persistent_path's)."""
    plan(persistent_rows=0, persistent_draft=False)


WIDE = dict(hidden=128, tokens=(4, 6))  # the wide target's width, and fewer tokens: its attention kernels
# step through the interpreter slowly on the CPU


def _generate(target_dir, kernels: str, monkeypatch, spec=None, hidden=64, tokens=(5, 8)):
    monkeypatch.setenv("EYAS_KERNELS", kernels)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 11)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in tokens]
    # Frozen as a loaded draft is (the kernels have no backward, so a draft that trains keeps the torch paths).
    draft = random_draft(hidden, 32, draft_vocab=24, head_dim=hidden // 4).requires_grad_(False) if spec else None
    engine = Engine(target_dir, dtype="fp32", device="cuda" if CUDA else "cpu", max_batch=2, max_len=64,
                    draft=draft, spec=spec)
    return [s.output_ids for s in engine.generate(prompts, params)]


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)],
                         ids=["plain", "chain", "tree"])
def test_kernels_give_the_reference_tokens(target_dir, monkeypatch, spec):
    reference = _generate(target_dir, "0", monkeypatch)  # plain greedy, torch paths
    assert _generate(target_dir, "force", monkeypatch, spec) == reference


def test_chain_acceptance_through_torch_ops_gives_the_reference_tokens(target_dir, monkeypatch, plan):
    """The plan's accept_kernel=False: a chain's acceptance through the torch ops while every other kernel runs (the
    default, one launch through eyas.kernels.chain_accept, is the chain case above)."""
    reference = _generate(target_dir, "0", monkeypatch)
    plan(accept_kernel=False)
    assert _generate(target_dir, "force", monkeypatch, SpecConfig(3, 1, adaptive=False)) == reference


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 2, 5, adaptive=False)], ids=["plain", "tree"])
def test_kernels_over_the_cache_give_the_reference_tokens(wide_target_dir, monkeypatch, spec):
    """The same with the slot-attention kernels in play, in the target and the draft (head dim 32): rotary
    fused with the cache write, tree masks."""
    reference = _generate(wide_target_dir, "0", monkeypatch, **WIDE)
    assert _generate(wide_target_dir, "force", monkeypatch, spec, **WIDE) == reference


def test_rotary_inside_attention_gives_the_reference_tokens(wide_target_dir, monkeypatch):
    """From ROTARY_IN_ATTENTION_MIN_WIDTH on (lowered here to take the tiny model's width) the attention kernel
    rotates q and k and writes the cache itself, in the
    target (prefill, tree verify) and the draft (prefill, tree steps, extend); rotate_and_store never runs.
    A chain's causal verify is the kernel test's (tests/kernels/test_slot_attention.py)."""
    import eyas.kernels.rotary as rotary
    import eyas.layers.attention as attention

    reference = _generate(wide_target_dir, "0", monkeypatch, **WIDE)
    calls = []
    monkeypatch.setattr(rotary, "rotate_and_store", lambda *args: calls.append(1))
    monkeypatch.setattr(attention, "ROTARY_IN_ATTENTION_MIN_WIDTH", 1)
    assert _generate(wide_target_dir, "force", monkeypatch, SpecConfig(3, 2, 5, adaptive=False), **WIDE) == reference
    assert not calls


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)],
                         ids=["plain", "chain", "tree"])
def test_norm_qkv_and_rotary_in_one_kernel_give_the_reference_tokens(wide_target_dir, monkeypatch, plan, spec):
    """The plan's qkv_rotary_rows past the kernel's limit: each target layer's input norm, q/k/v projection,
    rotary and cache write run as one kernel (eyas.kernels.qkv_rotary) for decode steps and verify passes;
    rotate_and_store is left to the draft."""
    import eyas.kernels.qkv_rotary as qkv_rotary

    reference = _generate(wide_target_dir, "0", monkeypatch, **WIDE)
    calls = []
    monkeypatch.setattr(qkv_rotary, "norm_qkv_rotary",
                        lambda *args, _f=qkv_rotary.norm_qkv_rotary: calls.append(1) or _f(*args))
    plan(qkv_rotary_rows=1 << 30)
    assert _generate(wide_target_dir, "force", monkeypatch, spec, **WIDE) == reference
    assert calls or CUDA  # graph replays make no Python calls


def test_rotary_moves_into_attention_from_wide_queries():
    """The attention kernel rotates q and k itself from ROTARY_IN_ATTENTION_MIN_WIDTH on (an 8B model's
    32 x 128), not at SmolLM2's 9 x 64."""
    from eyas.layers.attention import ROTARY_IN_ATTENTION_MIN_WIDTH, rotary_in_attention

    smollm2, llama_8b = torch.zeros(1, 1, 9, 64), torch.zeros(1, 1, 32, 128)
    at, below = ROTARY_IN_ATTENTION_MIN_WIDTH // 64, ROTARY_IN_ATTENTION_MIN_WIDTH // 64 - 1
    assert rotary_in_attention(llama_8b) and not rotary_in_attention(smollm2)
    assert rotary_in_attention(torch.zeros(1, 4, at, 64)) and not rotary_in_attention(torch.zeros(1, 4, below, 64))


def test_kernels_run_when_forced(monkeypatch):
    """Guards the test above against silently comparing the reference with itself."""
    from eyas.kernels import enabled

    x = torch.zeros(2)
    monkeypatch.setenv("EYAS_KERNELS", "force")
    assert enabled(x)
    assert not enabled(torch.zeros(2, requires_grad=True))  # no backward: training keeps the torch paths
    monkeypatch.setenv("EYAS_KERNELS", "0")
    assert not enabled(x)


@pytest.mark.skipif(CUDA, reason="counts Python calls of the kernels, which CUDA-graph replays do not make")
@pytest.mark.parametrize("fused_linear", [True, False])
def test_residual_adds_and_cache_writes_have_no_launches_of_their_own(wide_target_dir, monkeypatch, plan,
                                                                      fused_linear):
    """Per forward of the 3-layer target (every forward here has at most MAX_ROWS tokens): no residual add
    and no norm has a launch of its own. With the fused linears each layer's two norms (and the adds before
    them) run inside its q/k/v and gate/up projections and SiLU-and-mul inside the down projection, and only
    the final norm launches; without them, one plain norm (layer 0's input) and two fused add+norms per layer
    (the last layer's second one is the final norm). Per layer one launch rotates q and k and writes k and v
    into the cache; at up to two rows (by default) that launch is the q/k/v projection's own
    (eyas.kernels.qkv_rotary), where the fused linears run."""
    import eyas.kernels.activation as activation
    import eyas.kernels.fused_linear as fused
    import eyas.kernels.norm as norms
    import eyas.kernels.qkv_rotary as qkv_rotary
    import eyas.kernels.rotary as rotary
    import eyas.layers.attention as attention
    import eyas.kernels.slot_attention as slot_attention

    calls = {}
    for module, names in ((norms, ("rms_norm", "add_rms_norm")), (rotary, ("apply_rotary", "rotate_and_store")),
                          (slot_attention, ("store_kv",)), (fused, ("norm_linear", "silu_mul_linear")),
                          (activation, ("silu_mul",)), (qkv_rotary, ("norm_qkv_rotary",))):
        for name in names:
            calls[name] = 0

            def counted(*args, _name=name, _fn=getattr(module, name), **kwargs):
                calls[_name] += 1
                return _fn(*args, **kwargs)
            monkeypatch.setattr(module, name, counted)
    monkeypatch.setenv("EYAS_KERNELS", "force")
    plan(fused_linear=fused_linear)  # qkv_rotary_rows: the default
    engine = Engine(wide_target_dir, dtype="fp32", device="cpu", max_batch=1, max_len=32)
    engine.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))  # a 2-row prefill, 2 decode steps
    forwards, steps, layers = 3, 2, 3
    common = {"apply_rotary": 0, "store_kv": 0}
    if fused_linear:
        assert calls == {**common, "rms_norm": 0, "add_rms_norm": forwards, "silu_mul_linear": forwards * layers,
                         "silu_mul": 0, "norm_qkv_rotary": forwards * layers,  # the prefill's 2 rows too
                         "rotate_and_store": 0, "norm_linear": forwards * layers}
    else:
        assert calls == {**common, "rms_norm": forwards, "add_rms_norm": forwards * layers * 2, "norm_linear": 0,
                         "silu_mul_linear": 0, "silu_mul": forwards * layers, "norm_qkv_rotary": 0,
                         "rotate_and_store": forwards * layers}
