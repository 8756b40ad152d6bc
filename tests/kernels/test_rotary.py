"""The fused rotary kernel against eyas.layers.rotary.RotaryEmbedding.

Asserted: bit-equality, in fp32 and bf16. The kernel rounds exactly where torch does (the cos/sin rows to
q's dtype, each product, the sum) and multiply-add fusion is off, so nothing may differ; a skipped rounding,
a swapped sign in rotate-half or a misread position or stride breaks equality.
"""

import pytest
import torch

from eyas.kernels.rotary import apply_rotary, rotate_and_store
from eyas.kernels.slot_attention import store_kv
from eyas.layers.rotary import RotaryEmbedding, rotate_half

MAX_POSITIONS = 4096


@pytest.fixture(autouse=True)
def _torch_references(monkeypatch):
    """Should the layers dispatch to these kernels on CUDA, the references must still run their torch code."""
    monkeypatch.setenv("EYAS_KERNELS", "0")


def fused_qk(B, T, H, Hk, D, dtype, device):
    """q [B, T, H, D] and k [B, T, Hk, D] as the non-contiguous views a fused qkv projection splits into."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g).to(device, dtype)
    q, k, _ = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    return q.view(B, T, H, D), k.view(B, T, Hk, D)


def separate_qk(B, T, H, Hk, D, dtype, device):
    """A contiguous q, and a k laid out heads-first ([B, Hk, T, D] transposed): strides unlike q's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hk, T, D, generator=g).to(device, dtype).transpose(1, 2)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, Hk, D", [(2, 3, 4, 2, 64),   # prefill-shaped, grouped-query
                                            (2, 5, 9, 3, 64),   # SmolLM2's heads: the head tiles are masked
                                            (3, 1, 2, 1, 80)])  # decode; half of 80 is no power of two
@pytest.mark.parametrize("layout", [fused_qk, separate_qk])
def test_apply_rotary_matches_reference(device, dtype, B, T, H, Hk, D, layout):
    rope = RotaryEmbedding(D, 10000.0, None, MAX_POSITIONS).to(device)
    q, k = layout(B, T, H, Hk, D, dtype, device)
    positions = torch.randint(1, MAX_POSITIONS, (B, T), generator=torch.Generator().manual_seed(1)).to(device)
    q_out, k_out = apply_rotary(q, k, rope.cos, rope.sin, positions)
    ref_q, ref_k = rope(q, k, positions)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.dtype == dtype and torch.equal(q_out, ref_q)
    assert k_out.dtype == dtype and torch.equal(k_out, ref_k)


def test_apply_rotary_broadcast_positions_and_scaled_tables(device):
    """Positions as one row broadcast over the batch (stride 0), starting mid-sequence; yarn tables, whose
    attention factor scales cos/sin past 1."""
    B, T, H, Hk, D = 2, 4, 2, 2, 64
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    rope = RotaryEmbedding(D, 10000.0, scaling, MAX_POSITIONS).to(device)
    q, k = fused_qk(B, T, H, Hk, D, torch.bfloat16, device)
    positions = (1000 + torch.arange(T, device=device)).expand(B, T)
    q_out, k_out = apply_rotary(q, k, rope.cos, rope.sin, positions)
    ref_q, ref_k = rope(q, k, positions)
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)


def test_rotate_half_convention(device):
    """Tables of cos = 0 and sin = 1 (a quarter turn in every pair) give exactly rotate_half(q)."""
    D = 8
    cos, sin = torch.zeros(2, D, device=device), torch.ones(2, D, device=device)
    q = torch.arange(1.0, D + 1, device=device).view(1, 1, 1, D)
    q_out, k_out = apply_rotary(q, q, cos, sin, torch.ones(1, 1, dtype=torch.int64, device=device))
    assert torch.equal(q_out, rotate_half(q)) and torch.equal(k_out, rotate_half(q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, Hk, D", [(2, 3, 4, 2, 64), (3, 1, 2, 1, 80)])
def test_rotate_and_store_is_apply_rotary_then_store_kv(device, dtype, B, T, H, Hk, D):
    """One launch, the same bits as the two it replaces: the rotated q returned, the rotated k and the
    untouched v in their cache columns (rows in another order than the batch, columns mid-row), and every
    other cache entry left alone. v is strided as a fused qkv projection leaves it."""
    rope = RotaryEmbedding(D, 10000.0, None, MAX_POSITIONS).to(device)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g).to(device, dtype)
    q, k, v = (x.view(B, T, -1, D) for x in qkv.split([H * D, Hk * D, Hk * D], dim=-1))
    positions = torch.randint(1, MAX_POSITIONS, (B, T), generator=g).to(device)
    slots = torch.tensor([4, 0, 2][:B], device=device)
    write_pos = (torch.tensor([7, 0, 20][:B])[:, None] + torch.arange(T)[None, :]).to(device)
    k_cache, v_cache = (torch.randn(5, Hk, 32, D, generator=g).to(device, dtype) for _ in range(2))
    original_k, ref_k_cache, ref_v_cache = k_cache.clone(), k_cache.clone(), v_cache.clone()
    q_out = rotate_and_store(q, k, v, rope.cos, rope.sin, positions, k_cache, v_cache, slots, write_pos)
    ref_q, ref_k = apply_rotary(q, k, rope.cos, rope.sin, positions)
    store_kv(ref_k_cache, ref_v_cache, slots, write_pos, ref_k, v)
    assert q_out.is_contiguous() and torch.equal(q_out, ref_q)
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)
    assert not torch.equal(k_cache, original_k)  # the test writes something


def test_rotate_and_store_rejects_a_cache_of_other_heads(device):
    q = torch.zeros(1, 1, 2, 8, device=device)
    k = v = torch.zeros(1, 1, 1, 8, device=device)
    cache = torch.zeros(2, 2, 4, 8, device=device)  # two kv heads, k has one
    with pytest.raises(ValueError, match="caches"):
        rotate_and_store(q, k, v, torch.zeros(4, 8, device=device), torch.zeros(4, 8, device=device),
                         torch.zeros(1, 1, dtype=torch.int64, device=device), cache, cache.clone(),
                         torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, 1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_rotary_matches_torch_forward_and_backward(monkeypatch, device, dtype):
    """With a gradient, RotaryEmbedding runs the kernel both ways (the backward rotates by -sin)."""
    B, T, H, Hk, D = 2, 5, 9, 3, 64
    rope = RotaryEmbedding(D, 10000.0, None, MAX_POSITIONS).to(device)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(B, T, H, D, generator=g).to(device, dtype), torch.randn(B, T, Hk, D, generator=g).to(device, dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(device, dtype), torch.randn(k.shape, generator=g).to(device, dtype)
    positions = torch.randint(1, MAX_POSITIONS, (B, T), generator=g).to(device)

    def run(mode):
        monkeypatch.setenv("EYAS_KERNELS", mode)
        qa, ka = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        out_q, out_k = rope(qa, ka, positions)
        torch.autograd.backward([out_q, out_k], [dq, dk])
        return out_q, out_k, qa.grad, ka.grad

    want, got = run("0"), run("force")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the forward is bit-identical
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[2], want[2], **tol)
    torch.testing.assert_close(got[3], want[3], **tol)
