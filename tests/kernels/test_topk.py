"""The top-k kernel against torch.topk and torch.log_softmax (through Triton's interpreter on the CPU; on a
GPU with EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas.kernels.topk import MAX_K, MAX_WIDTH, fits, topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,k", [((3, 100), 1), ((2, 3, 64), 4), ((1, 8192), 2), ((5, 16), 16), ((4,), 3)])
def test_topk_matches_torch(device, dtype, shape, k):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(k)).to(device, dtype)
    values, indices = topk(x, k)
    ref_values, ref_indices = x.topk(k, dim=-1)
    assert values.dtype == dtype and indices.dtype == torch.long and values.shape == ref_values.shape
    assert torch.equal(values, ref_values)
    assert torch.equal(indices, ref_indices)  # random values: no ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_topk_matches_torch(device, dtype):
    x = (4 * torch.randn(3, 2, 500, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    values, indices = topk(x, 4, log_softmax=True)
    log_probs = torch.log_softmax(x.float(), dim=-1)
    ref_values = log_probs.topk(4, dim=-1).values
    assert values.dtype == torch.float32
    # bf16 rows tie: the entries taken must hold the reference's values, each index once
    assert torch.equal(log_probs.gather(-1, indices), ref_values)
    assert all(len(set(r)) == 4 for r in indices.flatten(0, 1).tolist())
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)  # the GPU's exp and log are approximate
    assert (values <= 0).all()


def test_ties_take_the_lower_index_first_and_every_index_once(device):
    x = torch.tensor([[1.0, 3.0, 3.0, -float("inf"), 3.0, 0.0], [-float("inf")] * 6], device=device)
    values, indices = topk(x, 4)
    assert indices.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]
    assert values[0].tolist() == [3.0, 3.0, 3.0, 1.0]
    one_hot = torch.zeros(2, 6, device=device)
    assert topk(one_hot, 1)[1].tolist() == [[0], [0]]  # torch.argmax's first index


def test_nan_counts_as_the_largest(device):
    x = torch.tensor([[0.5, float("nan"), 2.0]], device=device)
    assert topk(x, 2)[1].tolist() == [[1, 2]]


def test_rows_it_does_not_take_are_refused():
    assert fits(torch.zeros(2, MAX_WIDTH), MAX_K) and not fits(torch.zeros(2, MAX_WIDTH + 1), 1)
    assert not fits(torch.zeros(2, 8), 9) and not fits(torch.zeros(2, 8), 0)
    assert not fits(torch.zeros(2, 8, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="at most"):
        topk(torch.zeros(1, MAX_WIDTH + 1), 1)


def test_the_layer_falls_back_to_torch(monkeypatch, plan):
    """Without the kernels (EYAS_KERNELS=0, or the plan's topk_kernel=False), or for rows the kernel does not
    take, the layer is torch's."""
    from eyas.layers import topk as layer

    x = torch.randn(2, MAX_WIDTH + 8, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    assert torch.equal(layer.topk(x, 2)[1], x.topk(2, dim=-1).indices)
    calls = []
    import eyas.kernels.topk as kernels

    monkeypatch.setattr(kernels, "topk", lambda *a: calls.append(1) or torch.topk(a[0], a[1]))
    layer.topk(x[:, :50], 2)
    plan(topk_kernel=False)
    layer.topk(x[:, :50], 2)
    assert calls == [1]
    monkeypatch.setenv("EYAS_KERNELS", "0")
    small = x[:, :50]
    assert torch.equal(layer.argmax(small), small.argmax(-1))
    values, _ = layer.topk(small, 3, log_softmax=True)
    assert torch.equal(values, torch.log_softmax(small, dim=-1).topk(3, dim=-1).values)


def test_a_tree_keeps_every_parent_when_scores_tie(monkeypatch, device):
    """Exact ties between a parent and its children (children the draft was sure of, where the depth penalty
    vanishes in fp32 rounding at this magnitude): the kernel takes the lower pool index, which pool order
    gives to the parent, so no kept node's parent is left out."""
    from eyas.layers.draft_tree import select_tree

    monkeypatch.setenv("EYAS_KERNELS", "force")
    scores = torch.full((1, 6), -20.0, device=device)
    depth = torch.tensor([[1, 1, 2, 2, 2, 2]], device=device)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]], device=device)
    assert (scores - 1e-6 * depth).unique().numel() == 1  # the penalty rounds away: every key ties
    tree = select_tree(torch.tensor([7], device=device), torch.arange(10, 16, device=device)[None], scores, parents,
                       depth, num_nodes=4, max_depth=2)
    assert tree.tokens.tolist() == [[7, 10, 11, 12]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
