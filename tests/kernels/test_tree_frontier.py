"""The tree-frontier kernel against expand_frontier's torch ops (Triton's interpreter on the CPU; on a GPU with
EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas import execution_plan
from eyas.kernels.tree_frontier import tree_frontier
from eyas.layers.draft_tree import DraftPool, expand_frontier


def _step(B, k, W, H, device, first, ties=False, seed=0):
    """A frontier after the draft ran over it: the first step's (frontier and identity mask expanded from one
    row, as the drafter passes them) or a later one's; a pool with earlier columns already written."""
    g = torch.Generator().manual_seed(seed)
    scores = -torch.rand(B, k, generator=g) * 3
    child_scores = torch.log_softmax(torch.randn(B, k, 50, generator=g), -1).topk(k, -1).values
    if ties:  # every candidate ties: the lower index wins
        scores, child_scores = torch.full((B, k), -1.0), torch.full((B, k, k), -2.0)
    child_ids = torch.randint(0, 1000, (B, k, k), generator=g)
    out = torch.randn(B, k, H, generator=g)
    if first:
        frontier = torch.arange(k)[None].expand(B, k)
        mask = torch.eye(k, dtype=torch.bool)[None].expand(B, k, k)
    else:
        frontier = torch.randint(0, 40, (B, k), generator=g)
        mask = torch.rand(B, k, W, generator=g) < 0.5
    base = k if first else k + k * k
    P = base + k * k + 3
    pool = DraftPool(torch.randint(0, 9, (B, P), generator=g), torch.randn(B, P, generator=g),
                     torch.randint(0, 9, (B, P), generator=g))
    move = lambda t: t.to(device)  # noqa: E731
    return (DraftPool(*map(move, (pool.tokens, pool.scores, pool.parents))), base,
            *map(move, (scores, child_scores, child_ids, frontier, out, mask)))


@pytest.mark.parametrize("k,first", [(4, True), (4, False), (2, False), (8, False), (1, True)],
                         ids=["k4-first", "k4", "k2", "k8", "k1"])
def test_tree_frontier_matches_the_torch_ops(device, k, first):
    pool, base, *rest = _step(5, k, 2 * k, 24, device, first, seed=k)
    want_pool = DraftPool(pool.tokens.clone(), pool.scores.clone(), pool.parents.clone())
    got = tree_frontier(pool, base, *rest)
    with execution_plan.using(tree_kernels=False):
        want = expand_frontier(want_pool, base, *rest)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    for a, b in zip((pool.tokens, pool.scores, pool.parents), (want_pool.tokens, want_pool.scores, want_pool.parents)):
        assert torch.equal(a.cpu(), b.cpu())


def test_ties_go_to_the_lower_index(device):
    """Every candidate ties (torch.topk may order ties either way): the first k in order, frontier node 0's
    children first, each with its parent's hidden state and mask row."""
    pool, base, scores, child_scores, child_ids, frontier, out, mask = _step(2, 3, 6, 8, device, False, ties=True)
    next_scores, ids, hidden, next_frontier, next_mask = tree_frontier(pool, base, scores, child_scores, child_ids,
                                                                       frontier, out, mask)
    assert next_frontier.cpu().tolist() == [[base, base + 1, base + 2]] * 2
    assert torch.equal(ids, child_ids[:, 0]) and next_scores.eq(-3.0).all()
    assert torch.equal(hidden, out[:, :1].expand(-1, 3, -1)) and torch.equal(next_mask[:, :, :6], mask[:, :1].expand(-1, 3, -1))


def test_the_switch_sends_the_frontier_to_the_kernel(device, monkeypatch):
    import eyas.kernels.tree_frontier as kernel

    calls = []
    monkeypatch.setattr(kernel, "tree_frontier", lambda *a, _f=kernel.tree_frontier: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    pool, base, *rest = _step(2, 3, 6, 8, device, False)
    with execution_plan.using(tree_kernels=False):
        off = expand_frontier(DraftPool(pool.tokens.clone(), pool.scores.clone(), pool.parents.clone()), base, *rest)
    assert not calls
    on = expand_frontier(pool, base, *rest)
    assert calls and all(torch.equal(a, b) for a, b in zip(on, off))


def test_mismatched_inputs_are_refused(device):
    pool, base, scores, child_scores, child_ids, frontier, out, mask = _step(2, 3, 6, 8, device, False)
    with pytest.raises(ValueError, match="fp32"):
        tree_frontier(pool, base, scores.double(), child_scores, child_ids, frontier, out, mask)
    with pytest.raises(ValueError, match="room"):
        tree_frontier(pool, pool.tokens.shape[1] - 2, scores, child_scores, child_ids, frontier, out, mask)
