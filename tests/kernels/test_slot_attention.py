"""store_kv + slot_attention against the torch reference (`attend`: write, gather, SDPA with the prepared mask).

The kernels' cache holds NaN/inf past every row's own column count (and in the slots nobody uses), so a
kernel that read stale columns, or let them into the softmax, would fail; the reference cache holds
finite garbage there instead, since SDPA's additive mask does not survive NaN."""

import pytest
import torch

from eyas.layers.kv_cache import KVCache
from eyas.kernels.attention_splits import SPLIT_COLUMNS, choose_splits, merge_unrolled, one_pass_columns
from eyas.kernels.slot_attention import slot_attention, store_kv
from eyas.layers.attention import AttentionBatch, attend

SLOTS = [3, 0, 5]  # permuted, not a range; slots 1, 2, 4 are unused
KV_HEADS = 2
LAYER = 1
TOL = {torch.float32: dict(atol=1e-5, rtol=0), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def _new_mask(B, T, W, own, gen):
    """Random [B, T, W] tree mask in which token t always sees its own column own[b] + t."""
    mask = torch.rand((B, T, W), generator=gen) < 0.5
    rows = torch.arange(B)[:, None]
    mask[rows, torch.arange(T)[None, :], own[:, None] + torch.arange(T)[None, :]] = True
    return mask


def _run(device, dtype, T, G, D, mode, starts, visible=None, splits=None, max_len=40, pass_kv_len=True, tiles=None):
    gen = torch.Generator().manual_seed(1000 * T + 10 * G + D)
    B, H = len(SLOTS), KV_HEADS * G
    slots = torch.tensor(SLOTS)
    starts = torch.tensor(starts)
    new_mask = vis = None
    if mode == "causal":
        n_cols = starts + T
    else:
        vis = starts if visible is None else torch.tensor(visible)
        W = int((starts - vis).max()) + T          # equal for every row, as the draft builds it
        assert bool(((starts - vis) == W - T).all())
        new_mask = _new_mask(B, T, W, starts - vis, gen)
        n_cols = vis + W
    kv_len = int(n_cols.max())

    # Queries and new keys/values as non-contiguous views.
    q = torch.randn((B, H, T, D), generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn((B, T, 2 * KV_HEADS, D), generator=gen).to(dtype)[:, :, KV_HEADS:]
    v = torch.randn((B, KV_HEADS, T, D), generator=gen).to(dtype).transpose(1, 2)
    history_k = torch.randn((2, 6, KV_HEADS, max_len, D), generator=gen).to(dtype)
    history_v = torch.randn((2, 6, KV_HEADS, max_len, D), generator=gen).to(dtype)
    scale = D ** -0.5

    ref_kv = KVCache(2, 6, max_len, KV_HEADS, D, dtype, "cpu")
    ref_kv.k.copy_(history_k)
    ref_kv.v.copy_(history_v)
    batch = AttentionBatch(kv=ref_kv, slots=slots, starts=starts, kv_len=kv_len, new_mask=new_mask,
                           visible=None if visible is None else vis).prepare(T)
    expected = attend(q, k, v, LAYER, batch, scale)

    kv = KVCache(2, 6, max_len, KV_HEADS, D, dtype, device)
    kv.k.copy_(history_k)
    kv.v.copy_(history_v)
    kv.k[LAYER].fill_(float("inf"))
    kv.v[LAYER].fill_(float("nan"))
    for slot, n in zip(SLOTS, n_cols.tolist()):
        kv.k[LAYER, slot, :, :n] = history_k[LAYER, slot, :, :n]
        kv.v[LAYER, slot, :, :n] = history_v[LAYER, slot, :, :n]
        kv.k[LAYER, slot, :, n:] = float("nan")
    to = dict(device=device)
    store_kv(kv.k[LAYER], kv.v[LAYER], slots.to(**to), batch.write_pos.to(**to), k.to(**to), v.to(**to))
    out = slot_attention(q.to(**to), kv.k[LAYER], kv.v[LAYER], slots.to(**to), starts.to(**to), scale,
                         new_mask=None if new_mask is None else new_mask.to(**to),
                         visible=None if visible is None else vis.to(**to),
                         kv_len=kv_len if pass_kv_len else None, splits=splits, **(tiles or {}))
    assert out.shape == (B, T, H * D) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_causal_matches_reference(device, T, G, D):
    _run(device, torch.float32, T, G, D, "causal", starts=[5, 17, 0])


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_tree_verify_matches_reference(device, T, D):
    _run(device, torch.float32, T, 3, D, "tree", starts=[5, 17, 0])


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("G", [1, 3])
def test_draft_tree_matches_reference(device, T, G):
    """Draft step: earlier tree nodes [visible, starts) follow new_mask too, W = starts - visible + T."""
    _run(device, torch.float32, T, G, 64, "tree", starts=[2 + 2 * T, 10 + 2 * T, 2 * T], visible=[2, 10, 0])


@pytest.mark.parametrize("D", [32, 256])
def test_other_head_dims(device, D):
    _run(device, torch.float32, 4, 3, D, "tree", starts=[5, 17, 0])


@pytest.mark.parametrize("mode", ["causal", "tree"])
@pytest.mark.parametrize("T", [1, 9])
def test_bf16_matches_reference(device, T, mode):
    _run(device, torch.bfloat16, T, 3, 128, mode, starts=[5, 17, 0])


def test_several_query_blocks(device):
    """T * G = 72 query rows: two row blocks per kv head, also with split-K."""
    _run(device, torch.float32, 24, 3, 64, "tree", starts=[5, 3, 0])
    _run(device, torch.float32, 24, 3, 64, "causal", starts=[5, 3, 0], splits=2)


def test_kv_len_unknown(device):
    """Without kv_len the row lengths alone bound the columns read."""
    _run(device, torch.float32, 4, 3, 64, "causal", starts=[5, 17, 0], pass_kv_len=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_long_row(device, dtype):
    """A ~700-column row next to short ones: the heuristic splits it, and forced split counts agree."""
    assert choose_splits(len(SLOTS) * KV_HEADS, 704) > 1
    starts = [690, 3, 300]
    _run(device, dtype, 4, 3, 64, "causal", starts=starts, max_len=720)
    _run(device, dtype, 4, 3, 64, "causal", starts=starts, max_len=720, splits=5)
    _run(device, dtype, 4, 3, 64, "tree", starts=[690, 11, 300], visible=[682, 3, 292], max_len=720, splits=3)


@pytest.mark.parametrize("mode", ["causal", "tree"])
def test_short_splits(device, mode):
    """split_cols=32 with 32-column blocks (timing keywords): rows of 300 and 90 columns split into up to 9
    merged pieces, a 20-column row runs one pass; the output still matches the reference."""
    tiles = dict(split_cols=32, block_n=32, one_pass_cols=32)
    assert choose_splits(len(SLOTS) * KV_HEADS, 300, 32) == 9
    if mode == "causal":
        _run(device, torch.float32, 2, 3, 64, "causal", starts=[298, 88, 18], max_len=320, tiles=tiles)
    else:
        _run(device, torch.float32, 2, 3, 64, "tree", starts=[298, 88, 18], visible=[290, 80, 10], max_len=320,
             tiles=tiles)


@pytest.mark.parametrize("mode", ["causal", "tree"])
def test_split_merge_inside_the_kernel(device, monkeypatch, mode):
    from eyas import execution_plan

    """The default: the last split program of each row block merges; the same output as the merge
    kernel's, bit for bit (the same arithmetic), the counters back at zero after every launch, and a second
    launch over them right. A short row in the same launch runs one pass, as a launch without splits would.
    The merge's loops unrolled or not (MERGE_UNROLL_VALUES patched), in either kernel, add the same sums in the
    same order."""
    import eyas.kernels.attention_splits as attention_splits
    import eyas.kernels.slot_attention as kernels

    gen = torch.Generator().manual_seed(7)
    B, T, G, D, max_len = 2, 24, 3, 64, 720  # 72 query rows: two row blocks per kv head
    q = torch.randn((B, T, KV_HEADS * G, D), generator=gen).to(device)
    k_cache = torch.randn((4, KV_HEADS, max_len, D), generator=gen).to(device)
    v_cache = torch.randn((4, KV_HEADS, max_len, D), generator=gen).to(device)
    slots, starts = torch.tensor([3, 1], device=device), torch.tensor([690, 30], device=device)
    extra = {}
    if mode == "tree":
        extra = dict(new_mask=_new_mask(B, T, T, torch.zeros(B, dtype=torch.long), gen).to(device), visible=starts)

    def attention(splits=3):
        return slot_attention(q, k_cache, v_cache, slots, starts, D ** -0.5, kv_len=714, splits=splits, **extra)

    # Row 0 (714 columns) runs its 3 splits; row 1 (54, within one_pass_columns) one pass, as a 1-split launch.
    assert 30 + T <= one_pass_columns(D) < 690
    reference = attention(splits=1)
    merged = []
    with execution_plan.using(merge_in_kernel=False):  # the merge kernel
        for unroll in (1 << 30, 0):  # every merge unrolled, then none
            monkeypatch.setattr(attention_splits, "MERGE_UNROLL_VALUES", unroll)
            merged.append(attention()[0])
    assert torch.equal(merged[0], merged[1])
    reference[0] = merged[0]
    monkeypatch.setattr(kernels, "_counters", {})
    monkeypatch.setattr(kernels, "_combine_splits_kernel", None)  # the second kernel must not run
    for unroll in (1 << 30, 0):
        monkeypatch.setattr(attention_splits, "MERGE_UNROLL_VALUES", unroll)
        for _ in range(2):
            assert torch.equal(attention(), reference), unroll
            counters = kernels._counters[q.device]
            assert counters.numel() >= B * KV_HEADS * 2 and not counters.any()


def test_merge_unrolled_while_the_partials_fit_in_registers():
    """SmolLM2's steps (up to 16 splits of 16 rows at head dim 64) and the 8B decode and 4-token verify (16 x 16
    x 128) unroll; an 8B verify of 8 tokens (16 x 32 x 128) does not."""
    assert merge_unrolled(16, 16, 64) and merge_unrolled(16, 16, 128)
    assert not merge_unrolled(16, 32, 128) and merge_unrolled(8, 32, 128)


def test_outgrown_counters_stay_allocated(monkeypatch, plan):
    """A CUDA graph captured with the counters holds their address: when a larger batch needs more, the old
    tensor is kept alive (never freed and handed to another buffer), and zero."""
    import eyas.kernels.slot_attention as kernels

    monkeypatch.setattr(kernels, "_counters", {})
    monkeypatch.setattr(kernels, "_outgrown", [])
    q = torch.zeros(1)
    small = kernels.merge_in_kernel(q, 10)
    assert kernels.merge_in_kernel(q, 4096) is small  # fits: the same tensor
    large = kernels.merge_in_kernel(q, 5000)
    assert large.numel() >= 5000 and kernels._outgrown == [small] and not small.any()
    plan(merge_in_kernel=False)
    assert kernels.merge_in_kernel(q, 10) is None


def test_choose_splits():
    from eyas import execution_plan

    assert choose_splits(4, 4096) == 16  # long rows: up to 16 splits of >= 2 * SPLIT_COLUMNS columns
    assert choose_splits(3, 2048) == 16
    assert choose_splits(3, 1024) == 8
    assert choose_splits(256, 4096) == 1  # enough programs already
    assert choose_splits(3, 512) == 8  # short rows: splits of >= SPLIT_COLUMNS while programs are few
    assert choose_splits(24, 512) == 6
    assert choose_splits(48, 512) == 3
    assert choose_splits(3, 48) == 1
    assert choose_splits(128, 512) == 1
    with execution_plan.using(short_row_splits=False):
        assert choose_splits(3, 512) == 1
        assert choose_splits(3, 2048) == 16
    # shorter splits, for timing: short and long rows alike
    assert choose_splits(3, 512, 32) == 16 and choose_splits(8, 512, 32) == 16 and choose_splits(3, 1024, 32) == 16
    assert choose_splits(3, 96, 32) == 3


def test_one_pass_columns():
    """Rows past 64 columns split at head dim <= 64 (timed in whole steps), past 192 above."""
    assert one_pass_columns(64) == SPLIT_COLUMNS == 64 and one_pass_columns(128) == 192


@pytest.mark.parametrize("tiles, message", [(dict(split_cols=48), "split_cols=48"), (dict(block_n=8), "block_n=8"),
                                            (dict(one_pass_cols="many"), "one_pass_cols='many'")])
def test_tile_keywords_out_of_range_are_refused(tiles, message):
    q = torch.zeros((1, 1, 2, 64))
    cache = torch.zeros((1, 1, 8, 64))
    slots = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        slot_attention(q, cache, cache, slots, slots, 1.0, **tiles)


def test_head_dim_not_power_of_two_is_refused(device):
    kv = KVCache(1, 2, 8, 1, 48, torch.float32, device)
    q = torch.zeros((1, 1, 1, 48), device=device)
    one = torch.zeros(1, dtype=torch.long, device=device)
    with pytest.raises(ValueError):
        slot_attention(q, kv.k[0], kv.v[0], one, one, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_cache_write(device, dtype):
    gen = torch.Generator().manual_seed(7)
    B, T, H, D = 3, 5, 3, 64
    ref = KVCache(2, 6, 16, H, D, dtype, "cpu")
    ref.k.copy_(torch.randn(ref.k.shape, generator=gen))
    ref.v.copy_(torch.randn(ref.v.shape, generator=gen))
    kv = KVCache(2, 6, 16, H, D, dtype, device)
    kv.k.copy_(ref.k)
    kv.v.copy_(ref.v)
    slots = torch.tensor(SLOTS)
    write_pos = torch.tensor([2, 9, 0])[:, None] + torch.arange(T)[None, :]
    k = torch.randn((B, H, T, D), generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn((B, T, H, 2 * D), generator=gen).to(dtype)[..., D:]
    ref.write(LAYER, slots, write_pos, k, v)
    to = dict(device=device)
    store_kv(kv.k[LAYER], kv.v[LAYER], slots.to(**to), write_pos.to(**to), k.to(**to), v.to(**to))
    assert torch.equal(kv.k.cpu(), ref.k) and torch.equal(kv.v.cpu(), ref.v)


@pytest.mark.parametrize("T,G,mode,starts,visible,splits,dtype,D", [
    (1, 3, "causal", [700, 11, 300], None, 3, torch.bfloat16, 64),  # decode: each row's new column in its last split
    (1, 3, "causal", [700, 11, 300], None, 3, torch.float32, 64),
    (8, 3, "causal", [124, 40, 7], None, 3, torch.float32, 64),     # a chain's verify; row 0's columns span 2 splits
    (8, 3, "causal", [300, 11, 250], None, 2, torch.float32, 64),   # 24 query rows in blocks of 16 (below): two row
                                                                    # blocks write the same columns
    (5, 2, "tree", [690, 11, 300], None, 3, torch.bfloat16, 64),    # a tree verify
    (4, 3, "tree", [690, 19, 300], [682, 11, 292], 1, torch.float32, 64),  # a draft step: after the visible columns
    (1, 4, "causal", [700, 11, 300], None, 3, torch.bfloat16, 128),  # an 8B shape's heads, where it is the default
])
def test_rotary_inside_the_kernel(device, T, G, mode, starts, visible, splits, dtype, D, monkeypatch):
    """slot_attention(rotary=...) on unrotated q and new k/v gives the bits of rotate_and_store then
    slot_attention: the same output and the same caches."""
    import eyas.kernels.slot_attention as kernels
    from eyas.kernels.rotary import rotate_and_store
    from eyas.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(kernels, "MAX_BLOCK_M", 16)  # several row blocks from 6 tokens of 3 heads on

    gen = torch.Generator().manual_seed(T * 100 + G)
    B, max_len = len(SLOTS), 720
    slots, starts_t = torch.tensor(SLOTS, device=device), torch.tensor(starts, device=device)
    rope = RotaryEmbedding(D, 10000.0, None, 1024).to(device)
    positions = (starts_t[:, None] + torch.arange(T, device=device)[None]) % 1024
    write_pos = starts_t[:, None] + torch.arange(T, device=device)[None]
    extra = {}
    if mode == "tree":
        vis = starts_t if visible is None else torch.tensor(visible, device=device)
        W = int((starts_t - vis).max()) + T
        extra = dict(new_mask=_new_mask(B, T, W, (starts_t - vis).cpu(), gen).to(device),
                     visible=None if visible is None else vis)
    q = torch.randn((B, T, KV_HEADS * G, D), generator=gen).to(device, dtype)
    k = torch.randn((B, T, KV_HEADS, D), generator=gen).to(device, dtype)
    v = torch.randn((B, T, KV_HEADS, D), generator=gen).to(device, dtype)
    history = torch.randn((2, 6, KV_HEADS, max_len, D), generator=gen).to(device, dtype)
    caches = [(history[0].clone(), history[1].clone()) for _ in range(2)]

    (kc, vc), (kc2, vc2) = caches
    q_rot = rotate_and_store(q, k, v, rope.cos, rope.sin, positions, kc, vc, slots, write_pos)
    expected = slot_attention(q_rot, kc, vc, slots, starts_t, D ** -0.5, kv_len=max_len, splits=splits, **extra)
    out = slot_attention(q, kc2, vc2, slots, starts_t, D ** -0.5, kv_len=max_len, splits=splits,
                         rotary=(k, v, rope.cos, rope.sin, positions, write_pos), **extra)
    if device == "cpu":
        assert torch.equal(out, expected)
    else:  # compiled, the two kernels' attention arithmetic may contract differently into FMAs
        torch.testing.assert_close(out, expected, **TOL[dtype])
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
