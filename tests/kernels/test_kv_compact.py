"""The KV-compaction kernel against KVCache.compact's torch ops (Triton's interpreter on the CPU; on a GPU with
EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas import execution_plan
from eyas.kernels.kv_compact import kv_compact
from eyas.layers.kv_cache import KVCache


def _cache(device, shared, head_dim=12):
    kv = KVCache(3, 4, 32, 2, head_dim, torch.float32, device, shared=shared)
    g = torch.Generator().manual_seed(head_dim)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    if not shared:
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


@pytest.mark.parametrize("shared", [False, True], ids=["keys-and-values", "one-latent"])
@pytest.mark.parametrize("head_dim", [12, 64])
def test_kv_compact_matches_the_torch_ops(device, monkeypatch, shared, head_dim):
    """Paths that skip nodes (each move's source is overwritten by a later move's destination), one that keeps
    its columns, and a padding row that moves column 0 of the scratch row onto itself, twice."""
    monkeypatch.setenv("EYAS_KERNELS", "force")
    slots = torch.tensor([2, 0, 3, 3], device=device)
    c = torch.tensor([[10], [5], [0], [0]], device=device)
    sel = torch.tensor([[0, 2, 4, 5], [0, 1, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]], device=device)
    order = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]], device=device)
    got, want = _cache(device, shared, head_dim), _cache(device, shared, head_dim)
    before = want.k.clone()
    got.compact(slots, c + sel, c + order)
    with execution_plan.using(tree_kernels=False):
        want.compact(slots, c + sel, c + order)
    assert not torch.equal(want.k, before)  # columns moved
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert torch.equal(got.k[:, 2, :, 11], before[:, 2, :, 12]) and torch.equal(got.k[:, 2, :, 13], before[:, 2, :, 15])


def test_the_switch_sends_compaction_to_the_kernel(device, monkeypatch):
    import eyas.kernels.kv_compact as kernel

    calls = []
    monkeypatch.setattr(kernel, "kv_compact", lambda *a, _f=kernel.kv_compact: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    kv = _cache(device, False)
    slots, src, dst = (torch.tensor(x, device=device) for x in ([1], [[4, 6]], [[4, 5]]))
    with execution_plan.using(tree_kernels=False):
        kv.compact(slots, src, dst)
    assert not calls
    kv.compact(slots, src, dst)
    assert calls


def test_mismatched_inputs_are_refused(device):
    kv = _cache(device, False)
    with pytest.raises(ValueError, match="int64"):
        kv_compact(kv.k, kv.v, torch.tensor([0], device=device), torch.tensor([[1, 2]], device=device),
                   torch.tensor([[1.0, 2.0]], device=device))
    with pytest.raises(ValueError, match="contiguous"):
        kv_compact(kv.k.transpose(3, 4), None, torch.tensor([0], device=device), torch.tensor([[1]], device=device),
                   torch.tensor([[1]], device=device))
