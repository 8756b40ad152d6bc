"""Draft trees: from the pool of drafted candidates to the verify tree, and acceptance along it.

Nodes are numbered root first, then candidates in pool order (pool order is depth order, so every
parent precedes its children). A chain is the tree with topk = 1. Tensor math only, the torch reference of
the chain-acceptance kernel and the tree's frontier, selection and acceptance kernels; the speculative engine
(engine/drafter.py, engine/speculative.py) runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas import execution_plan
from eyas.kernels import enabled
from eyas.layers.sampling import sample_from
from eyas.layers.topk import topk


@dataclass
class DraftTree:
    tokens: torch.Tensor     # [B, N] target token ids, root first
    parents: torch.Tensor    # [B, N] parent node index (-1 for the root)
    depth: torch.Tensor      # [B, N]
    mask: torch.Tensor       # [B, N, N] node i sees node j iff j is i or an ancestor of i


def select_tree(root: torch.Tensor, pool_tokens: torch.Tensor, pool_scores: torch.Tensor,
                pool_parents: torch.Tensor, pool_depth: torch.Tensor, num_nodes: int, max_depth: int) -> DraftTree:
    """Keep the num_nodes-1 candidates with the highest cumulative log-probability.

    pool_*: [B, P]; pool_parents indexes the pool (-1 = child of the root); no candidate is deeper than
    max_depth. A tiny depth penalty breaks exact ties toward shallower nodes, so a kept node's parent is
    always kept too. With the kernels enabled, one launch (eyas.kernels.tree_select); the plan's
    tree_kernels=False keeps the torch ops (execution_plan).
    """
    if execution_plan.current().tree_kernels and enabled(pool_scores):
        from eyas.kernels.tree_select import tree_select

        return DraftTree(*tree_select(root, pool_tokens, pool_scores, pool_parents, pool_depth, num_nodes, max_depth))
    B = root.shape[0]
    keyed = pool_scores - 1e-6 * pool_depth
    chosen = topk(keyed, num_nodes - 1)[1].sort(dim=-1).values                       # [B, N-1] pool order
    parent_pool = pool_parents.gather(1, chosen)
    # pool index -> node index (chosen is sorted, so searchsorted finds the parent's node slot)
    parent_node = torch.searchsorted(chosen, parent_pool.clamp_min(0)) + 1
    parent_node = torch.where(parent_pool < 0, torch.zeros_like(parent_node), parent_node)
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=root.device), parent_node], dim=1)
    depth = torch.cat([torch.zeros((B, 1), dtype=torch.long, device=root.device), pool_depth.gather(1, chosen)], dim=1)
    tokens = torch.cat([root[:, None], pool_tokens.gather(1, chosen)], dim=1)
    # Each node sees itself, the root, and its ancestors between, a generation per op: max_depth - 1
    # generations above the deepest node is the root's child (the root is its own parent here, so a walk
    # from a shallower node that got there stays).
    up = parents.clamp_min(0)
    mask = torch.eye(num_nodes, dtype=torch.bool, device=root.device).expand(B, -1, -1).clone()
    mask[:, :, 0] = True
    above = up
    for generation in range(1, max_depth):
        mask.scatter_(2, above[..., None], True)
        if generation + 1 < max_depth:
            above = up.gather(1, above)
    return DraftTree(tokens, parents, depth, mask)


@dataclass
class DraftPool:
    """The candidates a tree pass drafts, [B, P] each, filled a depth at a time: k children of the root, then
    k * k per step. parents index the pool (-1 = a child of the root)."""
    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor


def expand_frontier(pool: DraftPool, base: int, scores: torch.Tensor, child_scores: torch.Tensor,
                    child_ids: torch.Tensor, frontier: torch.Tensor, out: torch.Tensor, mask: torch.Tensor):
    """One step of EAGLE-2's tree after the draft ran over its frontier: pool the frontier's children at
    columns base.. of `pool`, then keep the k with the highest cumulative log-probability as the next frontier.

    scores [B, k]: the frontier's cumulative log-probs; child_scores, child_ids [B, k, k]: each frontier node's
    top-k children (log-probs, draft ids); frontier [B, k]: its pool indices; out [B, k, H]: the draft's
    output at each frontier node; mask [B, k, W]: what each frontier node attended to (its ancestors' columns,
    then itself). Returns the next frontier's (scores, ids, hidden, pool indices, mask [B, k, W + k]).
    With the kernels enabled, one launch (eyas.kernels.tree_frontier); the plan's tree_kernels=False keeps
    the torch ops (execution_plan)."""
    if execution_plan.current().tree_kernels and enabled(scores):
        from eyas.kernels.tree_frontier import tree_frontier

        return tree_frontier(pool, base, scores, child_scores, child_ids, frontier, out, mask)
    B, k = scores.shape
    cum = (scores[..., None] + child_scores).flatten(1)                    # [B, k*k]
    pool.tokens[:, base:base + k * k] = child_ids.flatten(1)
    pool.scores[:, base:base + k * k] = cum
    pool.parents[:, base:base + k * k] = frontier.repeat_interleave(k, dim=1)
    next_scores, best = topk(cum, k)
    parent = best // k
    rows = torch.arange(B, device=scores.device)[:, None]
    eye = torch.eye(k, dtype=torch.bool, device=scores.device).expand(B, k, k)
    # A child sees what its parent saw (the parent's ancestors and the parent), then itself.
    return (next_scores, child_ids.flatten(1).gather(1, best), out[rows, parent], base + best,
            torch.cat([mask[rows, parent], eye], dim=-1))


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children, in node order (the draft's ranking order among siblings)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    return children


def accept_greedy(tokens: list[int], parents: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Longest root-to-node path whose every token equals the target's argmax at its parent.

    Returns (path node indices starting at the root, bonus token)."""
    children = _children(parents)
    path = [0]
    while True:
        want = target_argmax[path[-1]]
        nxt = next((c for c in children.get(path[-1], []) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)


def accept_greedy_batched(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor,
                          target_argmax: torch.Tensor, max_depth: int):
    """accept_greedy for a batch, on the device, in fixed shapes (CUDA-graph capturable, no sync).

    tokens, parents, depth, target_argmax: [B, N]; mask [B, N, N] the tree's (DraftTree.mask). Returns
    (sel [B, L], accepted [B], new [B, L]) with L = max_depth + 1: sel holds the path's nodes by depth (root
    first, 0 past its end); `accepted` counts its drafted nodes; new holds the tokens the path appends, the
    bonus token last and repeated past it. At most one node per depth can be accepted: siblings are distinct
    tokens and only one can equal the target's argmax at their parent, so the deepest accepted node is unique.
    A node is accepted when every node of its mask row matched, and the deepest one's mask row is the path:
    a fixed handful of ops whatever the depth. With the kernels enabled, one launch
    (eyas.kernels.tree_accept); the plan's tree_kernels=False keeps the torch ops (execution_plan)."""
    if execution_plan.current().tree_kernels and enabled(tokens):
        from eyas.kernels.tree_accept import tree_accept

        return tree_accept(tokens, parents, depth, mask, target_argmax, max_depth)
    B, N = tokens.shape
    L = max_depth + 1
    correct = tokens == target_argmax.gather(1, parents.clamp_min(0))
    correct[:, 0] = True
    ok = (mask <= correct[:, None, :]).all(dim=-1)                          # no unmatched node on its way up
    best = torch.where(ok, depth, -1).argmax(dim=1, keepdim=True)          # [B, 1] the deepest accepted node
    accepted = depth.gather(1, best)[:, 0]
    on_path = mask.gather(1, best[..., None].expand(B, 1, N))[:, 0]
    # Node j goes to column depth[j] when on the path; the others to a spare column L, dropped after.
    nodes = torch.arange(N, device=tokens.device).expand(B, N)
    sel = torch.zeros((B, L + 1), dtype=torch.long, device=tokens.device)
    sel.scatter_(1, torch.where(on_path, depth, L), nodes)
    sel = sel[:, :L]
    bonus = target_argmax.gather(1, best)
    drafted = tokens.gather(1, torch.cat([sel[:, 1:], sel[:, :1]], dim=1))  # the path's tokens after the root
    cols = torch.arange(L, device=tokens.device)[None]
    new = torch.where(cols < accepted[:, None], drafted, bonus)
    return sel, accepted, new


def accept_greedy_chain(tokens: torch.Tensor, target_argmax: torch.Tensor):
    """accept_greedy_batched for chains (node j is the child of node j-1): the same outputs from a running
    product of the matches instead of walks up the tree. With the kernels enabled, one launch
    (eyas.kernels.chain_accept); the plan's accept_kernel=False keeps the torch ops (execution_plan)."""
    if execution_plan.current().accept_kernel and enabled(tokens):
        from eyas.kernels.chain_accept import chain_accept

        return chain_accept(tokens, target_argmax)
    B, L = tokens.shape
    correct = (tokens[:, 1:] == target_argmax[:, :-1]).long()
    accepted = correct.cumprod(dim=1).sum(dim=1)                              # [B] leading matches
    cols = torch.arange(L, device=tokens.device)[None]
    sel = torch.where(cols <= accepted[:, None], cols, 0)
    bonus = target_argmax.gather(1, accepted[:, None])
    new = torch.where(cols < accepted[:, None], tokens.roll(-1, dims=1), bonus)
    return sel, accepted, new


def accept_sampled(tokens: list[int], parents: list[int], probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless acceptance for deterministic (top-k) proposals: at each node try its distinct children in
    order, accepting child x with probability p(x) under the current residual; a rejected token's
    mass is removed and the rest renormalized; the bonus token is drawn from the final residual.

    probs: [N, V] target probabilities (after temperature/top-p/top-k) at every node."""
    children = _children(parents)
    path = [0]
    while True:
        p = probs[path[-1]].clone()
        moved = False
        for c in children.get(path[-1], []):
            total = p.sum()
            u = torch.rand((), device=p.device, generator=generator)
            if total > 0 and u * total < p[tokens[c]]:
                path.append(c)
                moved = True
                break
            p[tokens[c]] = 0.0
        if not moved:
            return path, int(sample_from(p / p.sum(), generator))
