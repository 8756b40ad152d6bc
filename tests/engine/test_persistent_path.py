"""The engine with batch-1 passes through the persistent kernel (execution_plan's persistent_rows, and for these
fp32 targets persistent_skips_fp32 off; on the CPU through Triton's interpreter, EYAS_KERNELS=force): the same
greedy tokens as the torch reference paths, plain, chain and tree, and the passes did run there."""

from types import SimpleNamespace

import pytest
import torch

import eyas.engine.ahead as ahead_mod
from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.persistent import MAX_COLUMNS, REGISTER_TILE_BYTES, target_tiles, target_warps
from eyas.kernels.persistent_schedule import Tiles
from eyas.layers.draft_tree import DraftTree, select_tree
from eyas.layers.sampling import SamplingParams
from tests.conftest import on_gpu
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import random_draft, tiny_llama

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]' brings it)")

CUDA = on_gpu()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=32, layers=3, hidden=64)  # head_dim 16
    return str(path)


@pytest.fixture(autouse=True)
def fp32_through_the_kernel(plan):
    """These engines are fp32 (exact on the CPU), which the default plan keeps off the kernel."""
    plan(persistent_skips_fp32=False)


def _engine(target_dir, kernels: str, monkeypatch, spec=None, dtype="fp32"):
    monkeypatch.setenv("EYAS_KERNELS", kernels)
    draft = random_draft(64, 32, draft_vocab=24, head_dim=16).requires_grad_(False) if spec else None
    return Engine(target_dir, dtype=dtype, device="cuda" if CUDA else "cpu", max_batch=1, max_len=64, draft=draft,
                  spec=spec)


def _generate(engine, tokens=6):
    prompt = torch.randint(0, 32, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    return engine.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))[0].output_ids


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)],
                         ids=["plain", "chain", "tree"])
def test_persistent_passes_give_the_reference_tokens(target_dir, monkeypatch, plan, spec):
    """Plain steps, verify passes and a chain's draft steps (execution_plan's persistent_draft) through the
    kernel: the same tokens, and each pass's launches ran to the end."""
    reference = _generate(_engine(target_dir, "0", monkeypatch))  # plain greedy, torch paths
    plan(persistent_rows=8)
    engine = _engine(target_dir, "force", monkeypatch, spec)
    assert engine.execution_plan_summary["persistent_rows"] == 8
    # The engine's CUDA graphs hold the addresses of the target's weights: the kernel's stacked copies replace
    # them when the engine is built, before any graph is captured, so no pass may move them.
    addresses = [p.data_ptr() for p in engine.target.parameters()]
    assert _generate(engine) == reference
    assert [p.data_ptr() for p in engine.target.parameters()] == addresses
    ran = engine.runner.persistent.steps
    want = 1 if spec is None else spec.draft_tokens  # plain steps, or the verify passes
    assert want in ran and ran[want].counters_complete()
    if spec is not None and spec.topk == 1:  # each draft step of a chain's cycle has its own launch
        assert engine.execution_plan_summary["persistent_draft"] is True
        drafted = engine.decoder.drafter.persistent.steps
        assert sorted(drafted) == [2, 3] and all(step.counters_complete() for step in drafted.values())


def test_the_draft_keeps_its_path_where_the_plan_says(target_dir, monkeypatch, plan):
    """persistent_draft off: no draft step through the kernel; a tree's draft steps never go through it."""
    chain, tree = SpecConfig(3, 1, adaptive=False), SpecConfig(3, 2, 5, adaptive=False)
    assert _engine(target_dir, "force", monkeypatch, chain).decoder.drafter.persistent is not None
    assert _engine(target_dir, "force", monkeypatch, tree).decoder.drafter.persistent is None
    plan(persistent_draft=False)
    engine = _engine(target_dir, "force", monkeypatch, chain)
    assert engine.execution_plan_summary["persistent_draft"] is False
    assert not engine.decoder.drafter.persistent.serves(1, 64)


@pytest.mark.skipif(CUDA, reason="CUDA graphs faked on the CPU")
def test_plain_persistent_steps_ahead_of_the_host(target_dir, monkeypatch, plan, fake_graphs):
    """Inside the graphed plain step that runs ahead of the host (CUDA graphs faked, each body run twice per
    replay, two graphs sharing the step's buffers): the same tokens, and the steps did run ahead. A greedy
    cycle ahead of the host reaches the kernel through the same verify pass as the chain case above."""
    reference = _generate(_engine(target_dir, "0", monkeypatch), tokens=3)
    plan(persistent_rows=1, decode_ahead=True)  # the plain steps; the prefill keeps today's path
    replays = []
    real = ahead_mod.GraphPair.replay
    monkeypatch.setattr(ahead_mod.GraphPair, "replay", lambda self: replays.append(1) or real(self))
    engine = fake_graphs(_engine(target_dir, "force", monkeypatch))
    engine.runner.chunked_prefill = False  # eager: a graphed prefill pads to 64 tokens, 10x the interpreter's work
    assert _generate(engine, tokens=3) == reference
    assert replays and 1 in engine.runner.persistent.steps


def test_serves_short_passes_and_only_what_it_was_built_for(target_dir, monkeypatch, plan):
    served = _engine(target_dir, "force", monkeypatch).runner.persistent.serves  # the default: up to 8 tokens
    assert served(1, 8, 64) and not served(1, 9, 64)
    assert served(1, 1, MAX_COLUMNS) and not served(1, 1, 2 * MAX_COLUMNS)  # longer rows keep today's path
    plan(persistent_rows=0)
    engine = _engine(target_dir, "force", monkeypatch)
    assert engine.execution_plan_summary["persistent_rows"] == 0
    _generate(engine, tokens=3)
    assert not engine.runner.persistent.steps  # 0 keeps today's path
    plan(persistent_rows=16)
    assert not engine.runner.persistent.serves(1, 1, 64)  # the plan at build decides: the weights were not restacked
    served = _engine(target_dir, "force", monkeypatch).runner.persistent.serves  # past the kernel's 8 rows: 8
    assert served(1, 8, 64) and not served(1, 9, 64) and not served(2, 1, 64) and not served(1, 0, 64)
    plan(persistent_rows=4)
    served = _engine(target_dir, "force", monkeypatch).runner.persistent.serves
    assert served(1, 4, 64) and not served(1, 5, 64)
    assert _engine(target_dir, "0", monkeypatch).execution_plan_summary["persistent_rows"] == 0


def test_the_default_plan_keeps_fp32_targets_off_the_kernel(target_dir, monkeypatch, plan):
    """Where the kernel is slower (fp32) the engine keeps its own path unless the plan asks; a 16-bit target
    takes the kernel, at 4 warps a program for every row count (fp32 at 8)."""
    plan(persistent_skips_fp32=True)
    engine = _engine(target_dir, "force", monkeypatch)
    assert engine.runner.persistent.tiles is not None and not engine.runner.persistent.eligible
    assert engine.execution_plan_summary["persistent_rows"] == 0
    _generate(engine, tokens=2)
    assert not engine.runner.persistent.steps
    bf16 = _engine(target_dir, "force", monkeypatch, dtype="bf16").runner.persistent
    assert bf16.eligible and bf16.serves(1, 8, 64)
    assert target_warps(2) == 4 and target_warps(4) == 8
    assert [bf16.step(t).meta["num_warps"] for t in (1, 5, 8)] == [4, 4, 4]  # built, not launched


def _tree_of_8(device) -> DraftTree:
    """A drafted tree of 8 nodes with siblings at every depth, as the draft's select_tree builds it from its pool
    (tokens, parents, depth and each node's ancestor mask), every pool candidate kept."""
    pool_parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 4]], device=device)  # pool indices; -1: a child of the root
    pool_depth = torch.tensor([[1, 1, 2, 2, 2, 3, 3]], device=device)
    tree = select_tree(torch.tensor([5], device=device), torch.tensor([[11, 7, 20, 1, 30, 12, 9]], device=device),
                       -torch.arange(7.0, device=device)[None], pool_parents, pool_depth, 8, 3)
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 1, 2, 3, 5]]
    return tree


# The draft's default layers of a 3-layer target (2, 1, 0) read its embeddings, which the engine gathers;
# (1, 2, 1) the kernel writes itself (a layer may repeat). A chain of 4, and a tree of 8 (siblings at every
# depth, rotary positions by depth), the kernel's largest pass.
@pytest.mark.parametrize("layers,tree", [(None, False), ((1, 2, 1), False), ((1, 2, 1), True)],
                         ids=["with-embeddings", "written-by-the-kernel", "tree-of-8"])
def test_a_verify_pass_gives_the_models_logits_features_and_cache(target_dir, monkeypatch, plan, layers, tree):
    """What a drafted verify reads from the pass: the logits, the EAGLE-3 features of the draft's capture layers
    (which greedy tokens alone would not check: a wrong feature only lowers acceptance) and the cache."""
    plan(persistent_rows=8)
    engine = _engine(target_dir, "force", monkeypatch, SpecConfig(3, 1, adaptive=False))
    runner, dev = engine.runner, engine.device
    if layers:
        engine.target.capture_layers = layers
    assert engine.target.capture_layers == (layers or (2, 1, 0))
    runner.prefill(torch.tensor([[3, 9, 27, 4, 18, 30, 2]], device=dev), [0])
    if tree:
        drafted = _tree_of_8(dev)
        ids, depth, mask = drafted.tokens, drafted.depth, drafted.mask
    else:
        ids, depth, mask = torch.tensor([[5, 11, 7, 20]], device=dev), torch.arange(4, device=dev)[None], None
    k0, v0 = runner.kv.k.clone(), runner.kv.v.clone()
    out = runner.forward(ids, 7 + depth, [0], [7], new_mask=mask, graph=False)
    want_logits, want_aux = engine.target.logits(out.hidden), out.aux_hidden
    k_want, v_want = runner.kv.k.clone(), runner.kv.v.clone()
    runner.kv.k.copy_(k0)
    runner.kv.v.copy_(v0)
    tokens, logits, aux = runner.persistent.forward(ids, torch.tensor([7], device=dev), torch.tensor([0], device=dev),
                                                    depth if tree else None, mask)
    tol = 2e-3 if CUDA else 1e-4
    assert (logits - want_logits).abs().max() <= tol * want_logits.abs().max()
    assert torch.equal(tokens, want_logits.argmax(-1))
    assert aux.shape == want_aux.shape and (aux - want_aux).abs().max() <= tol * want_aux.abs().max()
    assert (runner.kv.k - k_want).abs().max() <= 1e-4 and (runner.kv.v - v_want).abs().max() <= 1e-4


def test_target_tiles_hold_a_bf16_tiles_bytes_in_fp32():
    """SmolLM2's widths: bf16 takes 16-row tiles everywhere (a rotation pair's half within a 64-wide head);
    fp32 halves the rows of q/k/v, gate/up and down, whose 16-row tiles would overflow an item's registers,
    and keeps o_proj's. A target whose bf16 tiles would not fit is not taken in any dtype."""
    cfg = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, head_dim=64)
    assert target_tiles(cfg, 2) == Tiles(qkv=16, o_proj=16, gate_up=16, down=16)
    fp32 = target_tiles(cfg, 4)
    assert fp32 == Tiles(qkv=8, o_proj=16, gate_up=8, down=8)
    assert fp32.down * 1536 * 4 <= REGISTER_TILE_BYTES < 2 * fp32.down * 1536 * 4
    assert target_tiles(SimpleNamespace(hidden_size=2048, intermediate_size=8192, num_heads=32, head_dim=64), 2) is None
    assert target_tiles(SimpleNamespace(hidden_size=2048, intermediate_size=8192, num_heads=32, head_dim=64), 4) is None
    assert target_tiles(SimpleNamespace(hidden_size=64, intermediate_size=128, num_heads=4, head_dim=16), 4).qkv == 8
