"""The tree-acceptance kernel against accept_greedy_batched's torch ops and the host's walk (Triton's interpreter on
the CPU; on a GPU with EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas.kernels.tree_accept import tree_accept
from eyas.layers.draft_tree import accept_greedy, accept_greedy_batched
from tests.engine.test_accept_batched import random_tree


def _verified(steps, topk, num_nodes, B=24):
    """A batch of drafted trees and target picks that accept paths of every length, on the CPU."""
    g = torch.Generator().manual_seed(steps * 100 + topk * 10 + num_nodes)
    tree = random_tree(B, steps, topk, num_nodes, 12, g)
    argmax = torch.randint(0, 12, (B, num_nodes), generator=g)
    for b in range(B):
        for j in range(1, num_nodes):
            if torch.rand((), generator=g) < 0.7:
                argmax[b, tree.parents[b, j]] = tree.tokens[b, j]
    return tree, argmax


@pytest.mark.parametrize("steps,topk,num_nodes", [(5, 4, 8), (3, 2, 6), (4, 3, 10), (2, 8, 17), (1, 2, 3)])
def test_tree_accept_matches_the_torch_ops_and_the_host(device, monkeypatch, steps, topk, num_nodes):
    monkeypatch.setenv("EYAS_KERNELS", "0")
    tree, argmax = _verified(steps, topk, num_nodes)
    inputs = [t.to(device) for t in (tree.tokens, tree.parents, tree.depth, tree.mask, argmax)]
    got = tree_accept(*inputs, steps)
    want = accept_greedy_batched(*inputs, steps)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.long and a.is_contiguous() and torch.equal(a.cpu(), b.cpu())
    for b in range(argmax.shape[0]):  # and the host's walk, which reads parents instead of the mask
        path, bonus = accept_greedy(tree.tokens[b].tolist(), tree.parents[b].tolist(), argmax[b].tolist())
        assert got[1][b].item() == len(path) - 1
        assert got[0][b].tolist() == path + [0] * (steps + 1 - len(path))
        assert got[2][b, len(path) - 1:].eq(bonus).all()
    if steps > 1:
        assert len(set(got[1].tolist())) >= 2  # paths of several lengths occurred


def test_the_switch_sends_trees_to_the_kernel(device, monkeypatch):
    import eyas.kernels.tree_accept as kernel
    from eyas import execution_plan

    tree, argmax = _verified(5, 4, 8)
    inputs = [t.to(device) for t in (tree.tokens, tree.parents, tree.depth, tree.mask, argmax)]
    calls = []
    monkeypatch.setattr(kernel, "tree_accept", lambda *a, _f=kernel.tree_accept: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with execution_plan.using(tree_kernels=False):
        off = accept_greedy_batched(*inputs, 5)
    assert not calls
    on = accept_greedy_batched(*inputs, 5)
    assert calls and all(torch.equal(a, b) for a, b in zip(on, off))


def test_mismatched_inputs_are_refused(device):
    longs = [torch.zeros(2, 4, dtype=torch.long, device=device) for _ in range(4)]
    with pytest.raises(ValueError, match="bool"):
        tree_accept(*longs[:3], torch.zeros(2, 4, 4, dtype=torch.long, device=device), longs[3], 3)
    with pytest.raises(ValueError, match="int64"):
        tree_accept(longs[0], longs[1][:, :3], longs[2], torch.zeros(2, 4, 4, dtype=torch.bool, device=device),
                    longs[3], 3)
