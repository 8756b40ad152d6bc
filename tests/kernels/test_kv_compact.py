"""The KV-compaction kernel against KVCache.compact_path's torch ops (Triton's interpreter on the CPU; on a GPU with
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


def _paths(device):
    """A path that skips nodes (each move's source is another move's destination), one that keeps its columns
    and stops early, and two padding rows that move column 0 of the scratch row onto itself."""
    slots = torch.tensor([2, 0, 3, 3], device=device)
    starts = torch.tensor([10, 5, 0, 0], device=device)
    sel = torch.tensor([[0, 2, 4, 5], [0, 1, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]], device=device)
    accepted = torch.tensor([3, 2, 0, 0], device=device)
    return slots, starts, sel, accepted


@pytest.mark.parametrize("shared", [False, True], ids=["keys-and-values", "one-latent"])
@pytest.mark.parametrize("head_dim", [12, 64])
def test_kv_compact_matches_the_torch_ops(device, monkeypatch, shared, head_dim):
    monkeypatch.setenv("EYAS_KERNELS", "force")
    got, want = _cache(device, shared, head_dim), _cache(device, shared, head_dim)
    before = want.k.clone()
    got.compact_path(*_paths(device))
    with execution_plan.using(tree_kernels=False):
        want.compact_path(*_paths(device))
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    moved = [(11, 12), (12, 14), (13, 15)]  # row 2: columns 12, 14, 15 to 11, 12, 13; the rest stay
    for dst, src in moved:
        assert torch.equal(got.k[:, 2, :, dst], before[:, 2, :, src])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[[dst for dst, _ in moved]] = False
    assert torch.equal(got.k[:, 2, :, untouched], before[:, 2, :, untouched])
    assert torch.equal(got.k[:, [0, 1, 3]], before[:, [0, 1, 3]])  # a path in place and padding change nothing


def test_the_switch_sends_compaction_to_the_kernel(device, monkeypatch):
    import eyas.kernels.kv_compact as kernel

    calls = []
    monkeypatch.setattr(kernel, "kv_compact", lambda *a, _f=kernel.kv_compact: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    kv = _cache(device, False)
    with execution_plan.using(tree_kernels=False):
        kv.compact_path(*_paths(device))
    assert not calls
    kv.compact_path(*_paths(device))
    assert calls


def test_mismatched_inputs_are_refused(device):
    kv = _cache(device, False)
    slots, starts, sel, accepted = _paths(device)
    with pytest.raises(ValueError, match="int64"):
        kv_compact(kv.k, kv.v, slots, starts.float(), sel, accepted)
    with pytest.raises(ValueError, match="contiguous"):
        kv_compact(kv.k.transpose(3, 4), None, slots, starts, sel, accepted)
