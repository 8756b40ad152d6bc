"""norm_qkv_rotary against the two kernels it replaces: norm_linear (residual add, RMSNorm, the fused q/k/v
projection) then rotate_and_store (rotary of q and k, k and v into the cache).

Asserted: h, the rotated q and every cache column equal the two-kernel path's, in fp32 and bf16, and no
other cache column is written. Both sides run in Triton's interpreter (or both compiled, with
EYAS_TEST_CUDA=1), so a misread pair, head, slot or position breaks equality; compiled, to the last bits
(_assert_same)."""

import pytest
import torch

from eyas.kernels.fused_linear import norm_linear
from eyas.kernels.qkv_rotary import norm_qkv_rotary
from eyas.kernels.rotary import rotate_and_store
from eyas.layers.rotary import RotaryEmbedding

EPS = 1e-5


def _inputs(B, T, H, Hk, D, K, dtype, device, bias, delta):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + H)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device, dtype)  # noqa: E731
    x = rnd(B, T, K)
    return dict(x=x, delta=rnd(B, T, K) if delta else None, norm_weight=rnd(K, scale=0.1) + 1,
                weight=rnd((H + 2 * Hk) * D, K, scale=K ** -0.5), bias=rnd((H + 2 * Hk) * D) if bias else None)


def _caches(slots, Hk, max_len, D, dtype, device):
    k = torch.full((slots, Hk, max_len, D), 7.0, dtype=dtype, device=device)
    return k, k.clone() - 14.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, Hk, D, K, bias, delta", [
    (1, 1, 9, 3, 64, 576, False, True),    # SmolLM2's decode step
    (1, 4, 9, 3, 64, 576, False, True),    # a chain's verify
    (2, 3, 4, 2, 32, 96, True, False),     # two sequences, qkv bias (Qwen2), no residual add
    (3, 1, 2, 1, 80, 160, False, True)])   # half of 80 is no power of two
def test_matches_norm_linear_then_rotate_and_store(device, dtype, B, T, H, Hk, D, K, bias, delta):
    a = _inputs(B, T, H, Hk, D, K, dtype, device, bias, delta)
    rope = RotaryEmbedding(D, 10000.0, None, 512).to(device)
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(4, generator=g)[:B].to(device)
    starts = torch.randint(0, 40, (B,), generator=g).to(device)
    write_pos = starts[:, None] + torch.arange(T, device=device)[None]
    positions = write_pos + 3
    k_ref, v_ref = _caches(4, Hk, 64, D, dtype, device)
    h_ref, qkv = norm_linear(a["x"], a["delta"], a["norm_weight"], EPS, a["weight"], a["bias"])
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    q_ref = rotate_and_store(q.view(B, T, H, D), k.view(B, T, Hk, D), v.view(B, T, Hk, D), rope.cos, rope.sin,
                             positions, k_ref, v_ref, slots, write_pos)
    k_cache, v_cache = _caches(4, Hk, 64, D, dtype, device)
    h, q_out = norm_qkv_rotary(a["x"], a["delta"], a["norm_weight"], EPS, a["weight"], a["bias"], H, Hk, rope.cos,
                               rope.sin, positions, k_cache, v_cache, slots, write_pos)
    assert q_out.shape == (B, T, H, D)
    for got, want in ((h, h_ref), (q_out, q_ref), (k_cache, k_ref), (v_cache, v_ref)):
        _assert_same(got, want)
    for cache, marker in ((k_cache, 7.0), (v_cache, -7.0)):  # exactly the written columns changed
        assert torch.equal(cache == marker, (k_ref if marker > 0 else v_ref) == marker)


def _assert_same(got: torch.Tensor, want: torch.Tensor):
    """Bit for bit in the interpreter. Compiled, the two kernels' sums over K may run in different orders
    (their tiles differ), so fp32 may differ in the last bits and bf16 by a rounding step."""
    if not got.is_cuda:
        assert torch.equal(got, want)
        return
    tol = 1e-5 if got.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_bad_shapes_are_refused(device):
    a = _inputs(1, 1, 2, 1, 32, 64, torch.float32, device, False, False)
    rope = RotaryEmbedding(32, 10000.0, None, 64).to(device)
    k_cache, v_cache = _caches(2, 1, 16, 32, torch.float32, device)
    pos = torch.zeros(1, 1, dtype=torch.long, device=device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="weight"):
        norm_qkv_rotary(a["x"], None, a["norm_weight"], EPS, a["weight"], None, 3, 1, rope.cos, rope.sin, pos,
                        k_cache, v_cache, slots, pos)
    with pytest.raises(ValueError, match="caches"):
        norm_qkv_rotary(a["x"], None, a["norm_weight"], EPS, a["weight"], None, 2, 1, rope.cos, rope.sin, pos,
                        k_cache[:, :, :, :16], v_cache, slots, pos)
    with pytest.raises(ValueError, match="rows"):
        x = torch.zeros(1, 9, 64, device=device)
        norm_qkv_rotary(x, None, a["norm_weight"], EPS, a["weight"], None, 2, 1, rope.cos, rope.sin,
                        pos.expand(1, 9), k_cache, v_cache, slots, pos.expand(1, 9))


@pytest.mark.parametrize("change, expected", [
    ({}, True), ({"plan_rows": None}, False), ({"plan_rows": None, "rows": 1}, True),
    ({"plan_rows": None, "rows": 2}, True), ({"plan_rows": None, "rows": 3}, False),
    ({"plan_rows": 0, "rows": 1}, False),
    ({"qk_norm": True}, False), ({"rows": 9}, False), ({"rotary_in_attention": True}, False), ({"kernels": "0"}, False), ({"K": 4096}, False)])
def test_the_layer_takes_the_kernel_only_where_both_kernels_it_replaces_would_run(monkeypatch, plan, change, expected):
    """eyas.layers.qkv_rotary.fused: the plan's qkv_rotary_rows (two by default; every row here unless
    plan_rows says otherwise, None: the default), no q/k norm, the fused projection's rows and features, the
    slot-attention kernel's cache, and the rotary not inside the attention kernel."""
    from types import SimpleNamespace

    from eyas.layers.kv_cache import KVCache
    import eyas.layers.attention as attention
    from eyas.layers.attention import AttentionBatch
    from eyas.layers.linear import ColumnParallelLinear
    from eyas.layers.norm import RMSNorm
    from eyas.layers.qkv_rotary import fused

    K, H, Hk, D = change.get("K", 128), 4, 2, 32
    monkeypatch.setenv("EYAS_KERNELS", change.get("kernels", "force"))
    if change.get("plan_rows", 1 << 30) is not None:
        plan(qkv_rotary_rows=change.get("plan_rows", 1 << 30))
    if change.get("rotary_in_attention"):  # as at a query width past the threshold
        monkeypatch.setattr(attention, "ROTARY_IN_ATTENTION_MIN_WIDTH", H * D)
    proj = ColumnParallelLinear(K, {"q": H * D, "k": Hk * D, "v": Hk * D}, False).requires_grad_(False)
    attn = SimpleNamespace(qk_norm=change.get("qk_norm", False), heads=H, kv_heads=Hk, head_dim=D, qkv_proj=proj)
    norm = RMSNorm(K, EPS).requires_grad_(False)
    kv = KVCache(1, 2, 32, Hk, D, torch.float32, "cpu")
    batch = AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([3]), kv_len=16)
    h = torch.zeros(1, change.get("rows", 4), K)
    assert fused(attn, h, torch.zeros_like(h), norm, batch) is expected


def test_a_pinned_tile_size_leaves_only_its_tiles_to_time():
    """block_h (a timing keyword): only tiles of that many pairs per program are timed, even past the
    product limit; any other value is refused in one line."""
    from eyas.kernels import qkv_rotary

    assert {c.kwargs["BLOCK_H"] for c in qkv_rotary._candidates(4, 576)} == {2, 4, 8}  # 2 x 4 x 8 x 1024 fits
    tiles = qkv_rotary._candidates(4, 576, block_h=16)
    assert tiles and {c.kwargs["BLOCK_H"] for c in tiles} == {16} and len(tiles) == 2  # both warp counts
    with pytest.raises(ValueError, match="one of \\[2, 4, 8, 16\\]") as e:
        qkv_rotary._candidates(4, 576, block_h=3)
    assert "\n" not in str(e.value)
