"""A chain's own draft function drafts exactly the tree the general one drafts with topk 1, at every cycle
of a real generation: the same tokens, parents, depths and mask (and the same draft cache writes)."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_chain_draft_equals_the_general_tree_with_topk_1(pair, steps):
    target, draft = pair
    engine = Engine(str(target), dtype="fp32", device="cpu", draft=str(draft),
                    spec=SpecConfig(steps, 1, adaptive=False),
                    max_batch=3, max_len=256)
    decoder = engine.decoder
    assert decoder.draft_fn == decoder.drafter.chain
    cycles = []

    def both(*args):
        general = decoder.drafter.tree(*args)
        chain = decoder.drafter.chain(*args)
        for a, b in zip(general, chain):
            assert a.shape == b.shape and torch.equal(a, b)
        cycles.append(1)
        return chain

    decoder.draft_fn = both
    g = torch.Generator().manual_seed(steps)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 21, 9)]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(cycles) >= 10
    assert sum(len(s.output_ids) - 1 for s in seqs) > sum(s.verify_passes for s in seqs)  # drafts were accepted
