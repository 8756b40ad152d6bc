"""Greedy acceptance on the device (fixed shapes, no sync) picks the same path and tokens as the host's."""

import pytest
import torch

from eyas.layers.draft_tree import accept_greedy, accept_greedy_batched, accept_greedy_chain, select_tree


def random_pool(B, steps, topk, vocab, g):
    """A draft's candidate pool as the tree pass builds one: top-k children per frontier node, depth by depth.
    Returns (root, tokens, scores, parents, depth), the last four [B, P]."""
    root = torch.randint(0, vocab, (B,), generator=g)
    tokens, parents, depth, scores = [], [], [], []
    frontier = torch.full((B, 1), -1)
    frontier_scores = torch.zeros(B, 1)
    base = 0
    for d in range(1, steps + 1):
        n = frontier.shape[1]
        child = torch.stack([torch.randperm(vocab, generator=g)[:topk] for _ in range(B * n)]).view(B, n * topk)
        s = (frontier_scores.repeat_interleave(topk, 1) - torch.rand(B, n * topk, generator=g))
        tokens.append(child)
        parents.append(frontier.repeat_interleave(topk, 1))
        depth.append(torch.full((B, n * topk), d))
        scores.append(s)
        keep = s.topk(topk, dim=1).indices
        frontier, frontier_scores = base + keep, s.gather(1, keep)
        base += n * topk
    return root, torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(depth, 1)


def random_tree(B, steps, topk, num_nodes, vocab, g):
    """A draft tree as the tree pass selects one from its pool."""
    return select_tree(*random_pool(B, steps, topk, vocab, g), num_nodes, steps)


@pytest.mark.parametrize("steps,topk,num_nodes", [(3, 1, 4), (5, 4, 8), (4, 3, 10), (2, 3, 6), (1, 4, 5)])
def test_the_tree_mask_names_each_nodes_ancestors(steps, topk, num_nodes):
    """select_tree's mask, built a generation at a time: row i holds i and every node on its walk up to the root."""
    g = torch.Generator().manual_seed(steps * 10 + topk)
    tree = random_tree(32, steps, topk, num_nodes, 12, g)
    for b in range(32):
        parents = tree.parents[b].tolist()
        want = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
        for i in range(num_nodes):
            j = i
            while j >= 0:
                want[i, j] = True
                j = parents[j]
        assert torch.equal(tree.mask[b], want)
    assert tree.depth.max().item() == steps  # the deepest nodes were kept, so the walk's length was tested


@pytest.mark.parametrize("steps,topk,num_nodes", [(3, 1, 4), (5, 4, 8), (4, 3, 10)])
def test_device_acceptance_equals_the_hosts(steps, topk, num_nodes):
    g = torch.Generator().manual_seed(steps * 100 + topk)
    vocab, B = 12, 64
    tree = random_tree(B, steps, topk, num_nodes, vocab, g)
    # The target's argmax at each node: often a child's token (so paths get accepted), else random.
    argmax = torch.randint(0, vocab, (B, num_nodes), generator=g)
    for b in range(B):
        for j in range(1, num_nodes):
            if torch.rand((), generator=g) < 0.7:
                argmax[b, tree.parents[b, j]] = tree.tokens[b, j]
    sel, accepted, new = accept_greedy_batched(tree.tokens, tree.parents, tree.depth, tree.mask, argmax, steps)
    lengths = set()
    for b in range(B):
        path, bonus = accept_greedy(tree.tokens[b].tolist(), tree.parents[b].tolist(), argmax[b].tolist())
        m = len(path) - 1
        lengths.add(m)
        assert accepted[b].item() == m
        assert sel[b].tolist() == path + [0] * (steps + 1 - len(path))
        want = [tree.tokens[b, j].item() for j in path[1:]] + [bonus]
        assert new[b].tolist() == want + [bonus] * (steps + 1 - len(want))
    assert len(lengths) > 2  # short and long paths both occurred
    if topk == 1:  # a chain's own acceptance gives the same three tensors
        for a, b in zip(accept_greedy_chain(tree.tokens, argmax), (sel, accepted, new)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("spec", [(3, 1, 4), (4, 3, 8)], ids=["chain", "tree"])
def test_the_engine_gives_the_same_tokens_and_passes_accepting_on_the_device_or_the_host(tmp_path, spec):
    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from tests.server.tiny import predictable_pair

    target, draft = predictable_pair(tmp_path / "target", tmp_path / "draft")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 30, 17)]
    outs = []
    for on_device in (True, False):
        engine = Engine(str(target), dtype="fp32", max_batch=3, max_len=256, draft=str(draft),
                        spec=SpecConfig(*spec, adaptive=False))
        engine.decoder.accept_on_device = on_device
        seqs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        outs.append([(s.output_ids, s.verify_passes) for s in seqs])
    assert outs[0] == outs[1]
    assert all(passes < 30 for _, passes in outs[0])  # drafts were accepted, several tokens per pass
