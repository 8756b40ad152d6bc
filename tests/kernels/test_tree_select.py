"""The tree-selection kernel against select_tree's torch ops (Triton's interpreter on the CPU; on a GPU with
EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas import execution_plan
from eyas.kernels.tree_select import tree_select
from eyas.layers.draft_tree import select_tree
from tests.engine.test_accept_batched import random_pool


@pytest.mark.parametrize("steps,topk,num_nodes", [(5, 4, 8), (3, 2, 6), (4, 3, 10), (2, 8, 17), (1, 2, 3), (6, 6, 64)])
def test_tree_select_matches_the_torch_ops(device, steps, topk, num_nodes):
    """Pools of 3 to 186 candidates (several of the kernel's 32-candidate chunks), trees of 3 to 64 nodes."""
    g = torch.Generator().manual_seed(steps * 100 + topk)
    pool = [t.to(device) for t in random_pool(16, steps, topk, 12, g)]
    got = tree_select(*pool, num_nodes, steps)
    with execution_plan.using(tree_kernels=False):
        want = select_tree(*pool, num_nodes, steps)
    for a, b in zip(got, (want.tokens, want.parents, want.depth, want.mask)):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    assert got[2].max().item() == min(steps, num_nodes - 1)


def test_ties_go_to_the_lower_pool_index_and_an_expanded_depth_row_is_read(device):
    """Every key ties (a pool the draft was sure of): the first candidates in pool order are kept, parents before
    their children; the depths come as one row expanded, as the drafter passes them."""
    scores = torch.full((2, 6), -20.0, device=device)
    depth = torch.tensor([[1, 1, 2, 2, 2, 2]], device=device).expand(2, -1)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]], device=device).expand(2, -1).contiguous()
    tokens = torch.arange(10, 22, device=device).view(2, 6)
    out_tokens, out_parents, out_depth, mask = tree_select(torch.tensor([7, 8], device=device), tokens, scores, parents,
                                                           depth, 4, 2)
    assert out_tokens.tolist() == [[7, 10, 11, 12], [8, 16, 17, 18]]
    assert out_parents.tolist() == [[-1, 0, 0, 1]] * 2 and out_depth.tolist() == [[0, 1, 1, 2]] * 2
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_the_switch_sends_selection_to_the_kernel(device, monkeypatch):
    import eyas.kernels.tree_select as kernel

    pool = [t.to(device) for t in random_pool(4, 3, 2, 12, torch.Generator().manual_seed(1))]
    calls = []
    monkeypatch.setattr(kernel, "tree_select", lambda *a, _f=kernel.tree_select: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with execution_plan.using(tree_kernels=False):
        off = select_tree(*pool, 6, 3)
    assert not calls
    on = select_tree(*pool, 6, 3)
    assert calls and all(torch.equal(getattr(on, f), getattr(off, f)) for f in ("tokens", "parents", "depth", "mask"))


def test_mismatched_inputs_are_refused(device):
    root, tokens, scores, parents, depth = random_pool(2, 2, 2, 12, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="fp32"):
        tree_select(root, tokens, scores.double(), parents, depth, 4, 2)
    with pytest.raises(ValueError, match="num_nodes"):
        tree_select(root, tokens, scores, parents, depth, 8, 2)
