"""The persistent decoder step (one launch, W=1: in Triton's interpreter, or compiled on a GPU with
EYAS_TEST_CUDA=1) equals eyas's model and HF: logits, KV-cache rows and tokens for a plain step and a 4-row
verify, with every counter at the schedule's target."""

import dataclasses
import re

import pytest
import torch
import transformers

from eyas.engine.persistent import target_tiles
from eyas.engine.runner import ModelRunner
from eyas.kernels.persistent_decode import OPS
from eyas.kernels.persistent_step import PersistentStep, expected_counts, item_table, pack_llama
from eyas.kernels.persistent_reference import PersistentReference
from eyas.kernels.persistent_schedule import Tiles, build_schedule
from eyas.models.loader import load_model
from tests.helpers import smollm2_shaped_llama
from tests.kernels.threaded_programs import ProgramsHung, concurrent_programs

TILES = Tiles(qkv=4, o_proj=16, gate_up=32, down=16, lm_head=64)  # several tiles per op at this size
PROMPT = 10
ROPE_THETA = 100000.0
# tl.dot takes fp32 operands as TF32 on a GPU (10-bit mantissa); the interpreter multiplies in full fp32.
TF32_TOL, FP32_TOL = 2e-3, 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=ROPE_THETA, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    model = load_model(path, "fp32", device)
    ids = torch.randint(0, 256, (1, PROMPT + 8), generator=torch.Generator().manual_seed(1)).to(device)
    return hf, model, ids


def run_both(model, ids, rows, tiles=TILES, block_t=16, programs=1, pairs=False):
    """(persistent logits, tokens, its cache, eyas's logits, eyas's cache, the step) after a shared prefill."""
    dev = ids.device
    runner = ModelRunner(model, num_slots=1, max_len=64, device=dev)
    runner.forward(ids[:, :PROMPT], torch.arange(PROMPT, device=dev)[None], [0], [0])
    k, v = runner.kv.k.clone(), runner.kv.v.clone()
    out = runner.forward(ids[:, PROMPT:PROMPT + rows], torch.arange(PROMPT, PROMPT + rows, device=dev)[None], [0],
                         [PROMPT])
    want = model.logits(out.hidden)[0]
    step = PersistentStep(pack_llama(model), rows, programs=programs, tiles=tiles, block_l=16,
                          block_t=block_t, pairs=pairs)
    logits, tokens = step(ids[0, PROMPT:PROMPT + rows].to(torch.int32), PROMPT, k, v)
    return logits, tokens, (k, v), want, (runner.kv.k, runner.kv.v), step


# The cache in one block; and in several blocks of 4 columns (each block's loads in flight while the one before
# is folded in).
@pytest.mark.parametrize("rows,block_t", [(1, 16), (4, 16), (2, 4)])
def test_step_equals_eyas_and_hf_logits_and_cache(tiny, rows, block_t):
    hf, model, ids = tiny
    if ids.device.type == "cuda" and block_t < 16:
        pytest.skip("tl.dot takes at least 16 columns on a GPU")
    logits, tokens, (k, v), want, (k_want, v_want), step = run_both(model, ids, rows, TILES, block_t)
    scale = want.abs().max()
    gpu = ids.device.type == "cuda"
    tol = (TF32_TOL if gpu else FP32_TOL) * scale
    assert (logits - want).abs().max() <= tol
    assert torch.equal(tokens, want.argmax(-1))
    with torch.no_grad():
        hf_logits = hf(ids[:, :PROMPT + rows].cpu()).logits[0, PROMPT:].to(ids.device)
    assert (logits - hf_logits).abs().max() <= tol
    # Every cache row: the step's new rows equal eyas's, and the prompt's rows are untouched.
    for got, ref in ((k, k_want), (v, v_want)):
        kv_tol = TF32_TOL * ref.abs().max() if gpu else 1e-5
        assert (got - ref).abs().max() <= kv_tol
    assert not torch.equal(k[:, 0, :, PROMPT:PROMPT + rows], torch.zeros_like(k[:, 0, :, PROMPT:PROMPT + rows]))
    assert step.counters_complete()
    assert step.counters.tolist() == expected_counts(step.schedule)


@pytest.mark.parametrize("rows", [1, 4])
def test_fp32_at_smollm2s_widths_with_the_engines_tiles(tmp_path, device, rows):
    """An fp32 target of SmolLM2's widths (one layer of them): its q/k/v, gate/up and down tiles take 8 rows
    (target_tiles), so that each holds what a bf16 one does, and the step still equals eyas's model."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=128,
                                   rope_theta=ROPE_THETA, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_model(tmp_path, "fp32", device)
    tiles = target_tiles(model.config, 4)
    assert (tiles.qkv, tiles.o_proj, tiles.gate_up, tiles.down) == (8, 16, 8, 8)
    ids = torch.randint(0, 256, (1, PROMPT + 8), generator=torch.Generator().manual_seed(1)).to(device)
    logits, tokens, (k, v), want, (k_want, v_want), step = run_both(model, ids, rows, tiles)
    gpu = ids.device.type == "cuda"
    assert (logits - want).abs().max() <= (TF32_TOL if gpu else FP32_TOL) * want.abs().max()
    assert torch.equal(tokens, want.argmax(-1))
    assert (k - k_want).abs().max() <= (TF32_TOL * k_want.abs().max() if gpu else 1e-5)
    assert step.counters_complete()


def emulate_pairs(hf, ids, rows, k, v, cos, sin):
    """(logits, the stream after the last layer) of the step's rows in plain fp32 torch, rounded to bf16 where
    word pairs round: each attention output, activation and residual write (the embeddings stay as they are).
    k, v hold the prompt's cache rows [L, slots, KV, len, D]; cos, sin the step's rotary rows [rows, D]."""
    cfg, w = hf.config, {name: t.float().cpu() for name, t in hf.state_dict().items()}
    nh, kvh, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    d = cfg.hidden_size // nh
    rb = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    norm = lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # noqa: E731
    cos, sin, k, v = cos.cpu()[:, None], sin.cpu()[:, None], k.cpu(), v.cpu()

    def rotated(x):  # [rows, heads, d], rotate-half
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    seen = torch.ones(rows, PROMPT + rows, dtype=torch.bool)
    seen[:, PROMPT:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    h = w["model.embed_tokens.weight"][ids[0, PROMPT:PROMPT + rows].cpu()]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q, kn = (rotated((x @ w[p + f"self_attn.{n}_proj.weight"].T).view(rows, -1, d)) for n in "qk")
        vn = (x @ w[p + "self_attn.v_proj.weight"].T).view(rows, -1, d)
        keys = torch.cat([k[layer, 0, :, :PROMPT].transpose(0, 1), kn])  # [PROMPT + rows, kv heads, d]
        values = torch.cat([v[layer, 0, :, :PROMPT].transpose(0, 1), vn])
        out = torch.stack([((q[:, i] @ keys[:, i // (nh // kvh)].T) * d ** -0.5).masked_fill(~seen, float("-inf"))
                           .softmax(-1) @ values[:, i // (nh // kvh)] for i in range(nh)], 1)
        h = rb(rb(out.reshape(rows, -1)) @ w[p + "self_attn.o_proj.weight"].T + h)
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = rb(rb(act) @ w[p + "mlp.down_proj.weight"].T + h)
    return norm(h, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T, h


# Producer tiles of one width, and of unequal widths that are not powers of two (tiles that end mid-block).
@pytest.mark.parametrize("rows,tiles", [(1, TILES), (4, TILES),
                                        (4, dataclasses.replace(TILES, o_proj=24, down=10, gate_up=18))])
def test_word_pairs_round_where_their_emulation_does(tiny, rows, tiles):
    """The residual stream, attention outputs and activations two bf16 to a word (a bf16 target's format,
    forced on an fp32 one): the logits and the stream (decoded from its pairs) are a plain torch emulation's
    that rounds at the same points (a pair's columns mixed up would miss by their own size); the tokens are
    eyas's, the cache rows within bf16 rounding of its."""
    hf, model, ids = tiny
    logits, tokens, (k, v), want, (k_want, v_want), step = run_both(model, ids, rows, tiles, pairs=True)
    assert step.act.shape[-1] == model.config.intermediate_size // 2
    p = step.packed
    emulated, stream = emulate_pairs(hf, ids, rows, k, v, p.cos[PROMPT:PROMPT + rows], p.sin[PROMPT:PROMPT + rows])
    # On a GPU the products' order differs, and a bf16 rounding may land one step (2^-8) apart.
    tol = 2 ** -8 if ids.device.type == "cuda" else FP32_TOL
    assert (logits.cpu() - emulated).abs().max() <= tol * emulated.abs().max()
    assert (step.stream(hf.config.num_hidden_layers).cpu() - stream).abs().max() <= tol * stream.abs().max()
    assert torch.equal(tokens, want.argmax(-1))
    plain, *_ = run_both(model, ids, rows, tiles)
    assert not torch.equal(logits, plain)  # the pairs did round
    for got, ref in ((k, k_want), (v, v_want)):
        assert (got - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    assert step.counters_complete()


def test_word_pairs_need_even_producer_tiles(tiny):
    _, model, _ = tiny
    packed = pack_llama(model)
    for tiles, match in ((dataclasses.replace(TILES, down=9), "down tiles of 9 over 64"),
                         (dataclasses.replace(TILES, gate_up=25), "gate_up tiles of 25 over 128"),
                         (dataclasses.replace(TILES, o_proj=7), "o_proj tiles of 7")):
        with pytest.raises(ValueError, match=match):
            PersistentStep(packed, 1, programs=1, tiles=tiles, pairs=True)
    PersistentStep(packed, 1, programs=1, tiles=dataclasses.replace(TILES, down=9))  # one value a word


def test_bf16_targets_pair_their_words_from_four_rows(tiny):
    """Word pairs by default only where they won: a bf16 target's passes of 4 rows or more, on tiles that pairs
    take; an fp32 target keeps one value a word."""
    _, model, _ = tiny
    packed = pack_llama(model)
    assert not any(PersistentStep(packed, r, programs=1, tiles=TILES).pairs for r in (1, 4, 8))
    bf16 = dataclasses.replace(packed, embed=packed.embed.to(torch.bfloat16))
    assert [PersistentStep(bf16, r, programs=1, tiles=TILES).pairs for r in (1, 2, 3, 4, 8)] == [False] * 3 + [True] * 2
    assert not PersistentStep(bf16, 4, programs=1, tiles=dataclasses.replace(TILES, down=9)).pairs
    assert not PersistentStep(bf16, 4, programs=1, tiles=TILES, pairs=False).pairs


@pytest.mark.parametrize("rows,programs,pairs", [(1, 4, False), (4, 7, False), (4, 5, True)])
def test_programs_at_once_give_one_programs_bits(tiny, rows, programs, pairs):
    """Several programs running at once (threads in Triton's interpreter), each polling the words the others
    write: logits, tokens and cache rows bit for bit those of one program running every item in turn, and
    every counter complete. (On a GPU the relaunch test below runs a program per SM.)"""
    _, model, ids = tiny
    if ids.device.type == "cuda":
        pytest.skip("threads stand in for a GPU's programs only in the interpreter")
    logits, tokens, (k, v), *_ = run_both(model, ids, rows, pairs=pairs)
    with concurrent_programs():
        got, got_tokens, (k_got, v_got), _, _, step = run_both(model, ids, rows, programs=programs, pairs=pairs)
    assert torch.equal(got, logits) and torch.equal(got_tokens, tokens)
    assert torch.equal(k_got, k) and torch.equal(v_got, v)
    assert step.counters_complete()


def test_a_poll_that_never_ends_is_reported(tiny):
    """The threaded launch itself: programs left waiting for words no one writes are stopped and reported."""
    _, model, ids = tiny
    if ids.device.type == "cuda":
        pytest.skip("threads stand in for a GPU's programs only in the interpreter")
    step = PersistentStep(pack_llama(model), 1, programs=2, tiles=TILES, block_l=16, block_t=16)
    # an o_proj item turned into a second argmax: it waits for LM-head tiles, which wait for its own tile
    first_o_proj = next(i.index for i in step.schedule.items if i.op == "o_proj")
    step.table[first_o_proj, 0] = OPS.index("argmax")
    k = torch.zeros(2, 1, 2, 64, 16)  # [layers, slots, kv heads, positions, head_dim]
    with concurrent_programs(deadline_s=10), pytest.raises(ProgramsHung, match="programs still ran") as hung:
        step(ids[0, :1].to(torch.int32), PROMPT, k, torch.zeros_like(k))
    # where each program waits, in the kernel's source, and the item it runs
    at = r"[^;]*persistent_words\.py:\d+ await_both <- [^;]*persistent_step_kernel \(item \d+\)"
    assert re.search(f"program 0 at {at}; program 1 at {at}$", str(hung.value))


def test_item_table_and_counter_targets_are_the_schedules(tiny):
    _, model, ids = tiny
    schedule = build_schedule(pack_llama(model).shape, TILES)
    table = item_table(schedule, ids.device)
    assert table.shape == (len(schedule.items), 8)
    counts = expected_counts(schedule)
    for item, row in zip(schedule.items, table.tolist()):
        assert row[5:] == [-1 if item.wait is None else item.wait, item.wait_count, item.signal]
        # A target no item can reach would spin forever on a GPU: every wait is satisfiable.
        assert item.wait is None or item.wait_count == counts[item.wait]


def test_an_unfinished_step_fails_the_counter_check(tiny):
    _, model, ids = tiny
    step = PersistentStep(pack_llama(model), 1, programs=1, tiles=TILES, block_l=16, block_t=16)
    # Dropping the argmax item from the table (a step that stops early) leaves its counter short.
    step.schedule = dataclasses.replace(step.schedule, items=step.schedule.items[:-1])
    step.table = step.table[:-1].contiguous()
    kv = torch.zeros(2, 1, 2, 64, 16, device=ids.device)
    step(ids[0, :1].to(torch.int32), 0, kv, kv.clone())
    assert not step.counters_complete()
    with pytest.raises(ValueError, match="1..8 rows"):
        PersistentStep(pack_llama(model), 9, programs=1)
    with pytest.raises(ValueError, match="captured layers"):  # the embeddings, or past the last layer
        PersistentStep(pack_llama(model), 1, programs=1, tiles=TILES, capture=(0, 1))


def test_tree_rows_in_another_slot_equal_the_reference_executor(tiny):
    """A draft tree (two branches of one parent, rotary positions by depth) written to slot 1 of 2: the
    kernel's logits and cache rows equal the plain-torch executor of the same items."""
    hf, model, ids = tiny
    dev = ids.device
    step = PersistentStep(pack_llama(model), 3, programs=1, tiles=TILES, block_l=16, block_t=16)
    ref = PersistentReference({k: v.cpu() for k, v in hf.state_dict().items()}, step.packed.shape, ROPE_THETA,
                              hf.config.rms_norm_eps, max_positions=64, tiles=TILES)
    ref.step(ids[0, :PROMPT].cpu(), 0)
    k = torch.zeros(2, 2, 2, 64, 16, device=dev)  # [layers, slots, kv heads, positions, head_dim]
    v = torch.zeros_like(k)
    k[:, 1], v[:, 1] = ref.k_cache.to(dev), ref.v_cache.to(dev)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()  # rows 1 and 2 are siblings
    depth = torch.tensor([PROMPT, PROMPT + 1, PROMPT + 1])
    rows = ids[0, PROMPT:PROMPT + 3].cpu()
    want, want_tokens = ref.step(rows, PROMPT, positions=depth, row_mask=tree)
    logits, tokens = step(rows.to(dev, torch.int32), PROMPT, k, v, slot=1, positions=depth, row_mask=tree)
    tol = (TF32_TOL if dev.type == "cuda" else FP32_TOL) * want.abs().max()
    assert (logits.cpu() - want).abs().max() <= tol
    assert torch.equal(tokens.cpu(), want_tokens)
    assert (k[:, 1].cpu() - ref.k_cache).abs().max() <= 1e-4 and (v[:, 1].cpu() - ref.v_cache).abs().max() <= 1e-4
    assert torch.equal(k[:, 0], torch.zeros_like(k[:, 0]))  # the other slot is untouched
    assert step.counters_complete()


@pytest.mark.parametrize("rows", [1, 4])
def test_every_program_relaunch_gives_the_same_bits(tmp_path, device, rows):
    """On a GPU, with a program per SM and SmolLM2-135M's shape (random bf16 weights): a step relaunched on the
    same inputs, after the same inputs or after others, gives the same logits and cache bits. (Where a tensor
    is smaller than a program's threads, the 1-row step read stale words until each thread checked its own.)"""
    if device != "cuda":
        pytest.skip("the interpreter runs one program at a time: no program reads another's words mid-step")
    vocab = smollm2_shaped_llama(tmp_path).config.vocab_size
    model = load_model(tmp_path, "bf16", device)
    runner = ModelRunner(model, num_slots=1, max_len=256, device=device)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (1, 200), generator=g).to(device)
    runner.forward(prompt, torch.arange(200, device=device)[None], [0], [0])
    k, v = runner.kv.k, runner.kv.v
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step = PersistentStep(pack_llama(model), rows, programs=sms)
    ids, other = (torch.randint(0, vocab, (rows,), generator=g).to(device, torch.int32) for _ in range(2))
    first = step(ids, 200, k, v)[0].clone()
    k_first, v_first = k.clone(), v.clone()
    for i in range(20):
        if i % 2:
            step(other, 200, k, v)
        assert torch.equal(step(ids, 200, k, v)[0], first), i
        assert torch.equal(k, k_first) and torch.equal(v, v_first), i


def test_the_kernel_compiles_for_sm90_without_spills():
    """Triton's interpreter runs programs its compiler rejects (a name bound to two types in two branches):
    the kernel compiles for sm_90 at 1 and 8 rows, 8 warps x its registers fit one program per SM, the
    1-row step spills nothing, only its polls nap, no poll ends on a reduction that Triton keeps within each warp,
    and the SASS's barriers and instructions after the poll are counted for each op."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "persistent_registers.py"
    p = subprocess.run([sys.executable, str(script), "--rows", "1,8", "--warps", "8"], capture_output=True,
                       text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if line[2:3].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 8]
    assert all(r[5].strip() == "True" for r in rows), rows  # one program per SM fits
    assert int(rows[0][4]) == 0, rows[0]  # the plain step spills nothing
    assert [r[8].strip() for r in rows] == ["True", "False"], rows
    assert [int(r[9]) for r in rows] == [0, 0], rows  # no poll can leave the program's warps in different rounds
    for r in rows:  # one count per op, each item reducing across its warps at least once
        barriers, instructions = ([int(n) for n in r[i].split("/")] for i in (10, 11))
        assert len(barriers) == len(instructions) == 7 and all(n > 0 for n in barriers), r
        assert all(i > b for i, b in zip(instructions, barriers)), r


def test_short_counters_name_where_an_unfinished_launch_stopped(tiny):
    """What a hung launch's counters say: each one short of its target, by name (op and layer)."""
    _, model, ids = tiny
    step = PersistentStep(pack_llama(model), 1, programs=1, tiles=TILES, block_l=16, block_t=16)
    counts = step.expected.cpu().clone()
    assert step.short_counters(counts) == []
    names = step.schedule.counters
    counts[names.index("attend[1]")] -= 1
    counts[names.index("argmax")] = 0
    want = step.expected[names.index("attend[1]")].item()
    assert step.short_counters(counts) == [f"attend[1] {want - 1} of {want}", "argmax 0 of 1"]
