"""An EAGLE-3 draft's step as one persistent launch (W=1: in Triton's interpreter, or compiled on a GPU with
EYAS_TEST_CUDA=1) equals eyas's draft forward: logits, argmax, the output hidden state (the next step's input)
and the draft cache's new rows, over a cache the draft itself filled. The engine's tiles for a draft fit what
an item holds in registers."""

import pytest
import torch

from eyas.draft_config import DraftConfig
from eyas.engine.persistent import REGISTER_TILE_BYTES
from eyas.engine.persistent_draft import draft_tiles
from eyas.kernels.persistent_schedule import Tiles
from eyas.kernels.persistent_step import PersistentStep, draft_unsupported, expected_counts, pack_eagle3
from eyas.layers.attention import AttentionBatch
from eyas.layers.kv_cache import KVCache
from eyas.models.loader import load_model
from tests.helpers import random_draft, tiny_llama

TILES = Tiles(qkv=4, o_proj=16, gate_up=32, down=16, lm_head=32)  # several tiles per op at this size
CACHED, SLOT = 11, 1
TF32_TOL, FP32_TOL = 2e-3, 1e-4  # tl.dot takes fp32 as TF32 on a GPU; the interpreter multiplies in fp32


@pytest.fixture(scope="module")
def pair(tmp_path_factory, device):
    path = tmp_path_factory.mktemp("target")
    tiny_llama(path, vocab=256, layers=2, hidden=64)
    target = load_model(path, "fp32", device)
    draft = random_draft(64, 256, draft_vocab=96, seed=3).fuse_projections().to(device).eval()
    return target.model.embed_tokens, draft


def draft_pass(draft, embed, kv, ids, hidden, start):
    """eyas's draft forward over draft ids [1, T] at columns start.. of SLOT (causal): its output [1, T, H]."""
    T, dev = ids.shape[1], ids.device
    batch = AttentionBatch(kv=kv, slots=torch.tensor([SLOT], device=dev), starts=torch.tensor([start], device=dev),
                           kv_len=kv.max_len)
    positions = start + torch.arange(T, device=dev)[None]
    with torch.no_grad():
        return draft(draft.embed_ids(ids, embed), hidden, positions, batch)


@pytest.mark.parametrize("rows", [1, 3])
def test_draft_step_equals_eyas_draft_forward(pair, device, rows):
    embed, draft = pair
    cfg = draft.config
    assert draft_unsupported(draft, embed) is None
    g = torch.Generator().manual_seed(rows)
    kv = KVCache(1, 2, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    prompt = torch.randint(0, cfg.draft_vocab_size, (1, CACHED), generator=g).to(device)
    draft_pass(draft, embed, kv, prompt, torch.randn(1, CACHED, cfg.hidden_size, generator=g).to(device), 0)
    k, v = kv.k.clone(), kv.v.clone()
    ids = torch.randint(0, cfg.draft_vocab_size, (1, rows), generator=g).to(device)
    hidden = torch.randn(1, rows, cfg.hidden_size, generator=g).to(device)
    out = draft_pass(draft, embed, kv, ids, hidden, CACHED)
    want = draft.logits(out)[0]

    step = PersistentStep(pack_eagle3(draft, embed), rows, programs=1, tiles=TILES, block_l=16, block_t=16)
    logits, tokens = step(ids[0], CACHED, k, v, slot=SLOT, hidden=hidden[0])
    tol = (TF32_TOL if device == "cuda" else FP32_TOL) * want.abs().max()
    assert (logits - want).abs().max() <= tol
    assert torch.equal(tokens, want.argmax(-1))
    assert (step.features - out[0]).abs().max() <= (TF32_TOL if device == "cuda" else FP32_TOL) * out.abs().max()
    assert (k - kv.k).abs().max() <= 1e-5 and (v - kv.v).abs().max() <= 1e-5  # the step's rows, and no others
    assert not torch.equal(k[0, SLOT, :, CACHED:CACHED + rows], torch.zeros_like(k[0, SLOT, :, CACHED:CACHED + rows]))
    assert step.counters.tolist() == expected_counts(step.schedule)


def test_the_draft_ids_reach_the_targets_embedding_through_d2t(pair, device):
    """With d2t withheld (every draft id read as the target's own), the step's output moves: the kernel maps ids."""
    embed, draft = pair
    cfg = draft.config
    kv = KVCache(1, 2, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    ids = torch.tensor([[5]], device=device)
    hidden = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    packed = pack_eagle3(draft, embed)
    assert int(packed.d2t[5]) != 0
    mapped = PersistentStep(packed, 1, programs=1, tiles=TILES, block_l=16, block_t=16)
    got, _ = mapped(ids[0], 0, kv.k.clone(), kv.v.clone(), slot=SLOT, hidden=hidden[0])
    packed.d2t = torch.zeros_like(packed.d2t)
    unmapped = PersistentStep(packed, 1, programs=1, tiles=TILES, block_l=16, block_t=16)
    other, _ = unmapped(ids[0], 0, kv.k.clone(), kv.v.clone(), slot=SLOT, hidden=hidden[0])
    want = draft.logits(draft_pass(draft, embed, kv, ids, hidden, 0))[0]
    assert (got - want).abs().max() <= 2e-3 * want.abs().max() < (other - want).abs().max()


def test_a_draft_step_needs_its_hidden_input_and_a_target_step_none(pair, device):
    embed, draft = pair
    cfg = draft.config
    kv = KVCache(1, 2, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    step = PersistentStep(pack_eagle3(draft, embed), 1, programs=1, tiles=TILES, block_l=16, block_t=16)
    ids = torch.tensor([3], device=device)
    with pytest.raises(ValueError, match="hidden input"):
        step(ids, 0, kv.k, kv.v, slot=SLOT)
    with pytest.raises(ValueError, match="hidden input must be contiguous"):
        step(ids, 0, kv.k, kv.v, slot=SLOT, hidden=torch.zeros(2, cfg.hidden_size, device=device))


def test_draft_tiles_are_the_largest_that_fit_an_items_registers():
    """The bundled draft's shape: q/k/v read 2H = 1,152 columns and the MLP is 2,816 wide, so q/k/v and down
    take 8 rows in bf16 (16 would overflow), 4 in fp32, and gate/up, allowed twice the bytes, 32 and 16; the
    8,192-row head is cut into 128 tiles. A draft too wide for 2-row tiles is not taken."""
    cfg = DraftConfig(hidden_size=576, intermediate_size=2816, num_heads=9, num_kv_heads=3, head_dim=64,
                      vocab_size=49152, draft_vocab_size=8192, target_hidden_size=576)
    assert draft_tiles(cfg, 2) == Tiles(qkv=8, o_proj=16, gate_up=32, down=8, lm_head=64)
    assert draft_tiles(cfg, 4) == Tiles(qkv=4, o_proj=16, gate_up=16, down=4, lm_head=64)
    for e in (2, 4):
        t = draft_tiles(cfg, e)
        assert 4 * t.qkv * 576 * e <= REGISTER_TILE_BYTES < 8 * t.qkv * 576 * e
        assert t.down * 2816 * e <= REGISTER_TILE_BYTES < 2 * t.down * 2816 * e
        assert 2 * t.gate_up * 576 * e <= 2 * REGISTER_TILE_BYTES < 4 * t.gate_up * 576 * e  # twice the bytes
    wide = DraftConfig(hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
                       vocab_size=128256, draft_vocab_size=32000, target_hidden_size=8192)
    assert draft_tiles(wide, 2) is None


def test_the_draft_form_compiles_for_sm90_without_spills():
    """The bundled draft's one-row step, compiled for sm_90 with the engine's tiles: no spill, one program per SM,
    and every op's item reduces across its warps."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "persistent_registers.py"
    p = subprocess.run([sys.executable, str(script), "--draft", "--rows", "1", "--warps", "8"], capture_output=True,
                       text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if line[2:3].isdigit()]
    assert len(rows) == 1 and int(rows[0][0]) == 1, rows
    assert int(rows[0][4]) == 0 and rows[0][5].strip() == "True", rows  # no spill; one program per SM
    assert all(int(n) > 0 for n in rows[0][10].split("/")), rows
