"""The persistent step's work-item schedule: complete dependencies, no deadlock, HF's tokens and logits."""

import dataclasses
import random

import pytest
import torch
import transformers

from eyas.kernels.persistent_reference import PersistentReference, interleave
from eyas.kernels.persistent_schedule import DecoderShape, Tiles, build_schedule, check_no_deadlock, deal

SMOLLM2 = DecoderShape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30, vocab=49152)
TILES = Tiles(qkv=4, o_proj=16, gate_up=32, down=16, lm_head=40, attend_splits=4)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    shape = DecoderShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=3, vocab=96)
    return model, shape


def reference(model, shape, tiles=TILES):
    return PersistentReference(model.state_dict(), shape, 10000.0, model.config.rms_norm_eps,
                               max_positions=64, tiles=tiles)


def test_smollm2_schedule_deals_to_any_program_count_without_deadlock():
    s = build_schedule(SMOLLM2, Tiles(attend_splits=4))
    # 15 fused heads in rotation pairs of 2 x 16 rows, 9 query heads in 4 splits, 16-row tiles of o/gate_up/down
    per_layer = 15 * 2 + 9 * 4 + 576 // 16 + 1536 // 16 + 576 // 16
    assert len(s.items) == 30 * per_layer + 49152 // 384 + 1
    for programs in (1, 7, 132):
        check_no_deadlock(s, deal(s, programs))


def test_a_queue_that_waits_on_work_behind_it_deadlocks():
    s = build_schedule(SMOLLM2, Tiles())
    one = [list(reversed(range(len(s.items))))]  # the argmax first: it waits for every lm_head tile
    with pytest.raises(RuntimeError, match="deadlock"):
        check_no_deadlock(s, one)
    with pytest.raises(ValueError, match="exactly once"):
        check_no_deadlock(s, [[0, 0]])


def test_qkv_tiles_must_split_half_a_head():
    with pytest.raises(ValueError, match="divide head_dim / 2"):
        build_schedule(SMOLLM2, Tiles(qkv=12))


def test_prefill_and_decode_match_hf_greedy_in_any_program_order(tiny):
    model, shape = tiny
    prompt = torch.tensor([5, 17, 3, 88, 41, 9])
    with torch.no_grad():
        want = model.generate(prompt[None], max_new_tokens=8, do_sample=False)[0, len(prompt):]
    ref = reference(model, shape)
    rng, queues = random.Random(0), deal(ref.schedule, 5)
    logits, tokens = ref.step(prompt, 0, interleave(ref.schedule, queues, rng))
    with torch.no_grad():
        hf = model(prompt[None]).logits[0]
    assert torch.allclose(logits, hf, atol=1e-5)
    got, pos = [int(tokens[-1])], len(prompt)
    while len(got) < len(want):
        _, tokens = ref.step(torch.tensor([got[-1]]), pos, interleave(ref.schedule, queues, rng))
        got.append(int(tokens[0]))
        pos += 1
    assert got == want.tolist()


def test_verify_rows_and_tree_mask_equal_hf_logits(tiny):
    model, shape = tiny
    seq = torch.tensor([7, 2, 60, 33, 12, 90, 4, 4, 21, 8, 75])
    with torch.no_grad():
        hf = model(seq[None]).logits[0]
    ref = reference(model, shape)
    ref.step(seq[:3], 0)
    logits, _ = ref.step(seq[3:11], 3)  # an 8-row verify after a 3-token prefix
    assert torch.allclose(logits, hf[3:11], atol=1e-5)
    # Two branches from the same parent: rows 1 and 2 both sit at depth 1 and see only the root.
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()
    logits, _ = ref.step(torch.tensor([seq[3], seq[4], 50]), 3, positions=torch.tensor([3, 4, 4]), row_mask=tree)
    with torch.no_grad():
        other = model(torch.cat([seq[:4], torch.tensor([50])])[None]).logits[0]
    assert torch.allclose(logits[1], hf[4], atol=1e-5)
    assert torch.allclose(logits[2], other[4], atol=1e-5)


def test_every_allowed_order_gives_bit_identical_logits(tiny):
    model, shape = tiny
    ref = reference(model, shape)
    ids = torch.tensor([1, 2, 3, 4])
    base, _ = ref.step(ids, 0)
    for seed in range(4):
        order = interleave(ref.schedule, deal(ref.schedule, 3 + seed), random.Random(seed))
        logits, _ = ref.step(ids, 0, order)
        assert torch.equal(logits, base)


@pytest.mark.parametrize("op", ["qkv", "attend", "o_proj", "gate_up", "down", "lm_head", "argmax"])
def test_a_missing_dependency_shows_in_some_order(tiny, op):
    """An op waiting for one producer fewer than it has: some order reads a half-written buffer."""
    model, shape = tiny
    ref = reference(model, shape)
    ids = torch.tensor([1, 2, 3, 4])
    base, base_tokens = ref.step(ids, 0)
    ref.schedule.items = [dataclasses.replace(it, wait_count=it.wait_count - 1)
                          if it.op == op and it.wait is not None else it for it in ref.schedule.items]
    differed = False
    for seed in range(20):
        for cache in (ref.k_cache, ref.v_cache):  # the slots this step writes, unwritten again
            cache[:, :, :len(ids)] = float("nan")
        logits, tokens = ref.step(ids, 0, interleave(ref.schedule, deal(ref.schedule, 4), random.Random(seed)))
        differed |= not torch.equal(logits, base) or not torch.equal(tokens, base_tokens)
    assert differed


def test_an_item_run_before_its_counter_is_refused(tiny):
    model, shape = tiny
    ref = reference(model, shape)
    first_attend = next(i.index for i in ref.schedule.items if i.op == "attend")
    order = [first_attend] + [i for i in range(len(ref.schedule.items)) if i != first_attend]
    with pytest.raises(RuntimeError, match="before its counter"):
        ref.step(torch.tensor([1]), 0, order)
