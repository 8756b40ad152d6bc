"""Every graph body the engine captures is pure or idempotent, as a GPU needs (its capture runs a body three
times): with graphs faked on the CPU, each body running twice per replay (fake_cuda_graphs.py), speculative
output still equals plain greedy output token for token. A commit body that moved cache columns in place (a
tree's KV compaction) without the verify pass before it fails here."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.engine.fake_cuda_graphs import fake_graphs  # noqa: F401 (a fixture)
from tests.helpers import random_draft, tiny_llama


@pytest.mark.parametrize("ahead", [True, False], ids=["cycle-graph", "in-step"])
@pytest.mark.parametrize("spec",
                         [SpecConfig(3, 1, adaptive=False), SpecConfig(5, 4, 8, adaptive=False),
                          SpecConfig(2, 3, 6, adaptive=False)],
                         ids=["chain", "tree", "tree-wide"])
def test_speculative_equals_greedy_with_graphs(tmp_path, fake_graphs, plan, spec, ahead):
    """Ahead of the host a cycle is one graph; in step with it (the plan's decode_ahead off: as tensor parallelism and
    the profiler run it) each pass is its own graph."""
    plan(decode_ahead=ahead)
    tiny_llama(tmp_path, vocab=32, layers=5, hidden=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    params = [SamplingParams(max_tokens=n) for n in (20, 35, 60, 60)]
    plain = Engine(str(tmp_path), dtype="fp32", max_batch=4, max_len=256)
    want = [s.output_ids for s in plain.generate(prompts, params)]
    engine = fake_graphs(Engine(str(tmp_path), dtype="fp32", max_batch=4, max_len=256,
                                draft=random_draft(64, 32, draft_vocab=24), spec=spec))
    got = engine.generate(prompts, params)
    assert [s.output_ids for s in got] == want
    if ahead:  # the cycles ran as whole-cycle graphs (ahead.py)
        assert engine.decoder.ahead.pairs
    else:  # the draft, verify and commit passes ran from their own graphs
        assert {"tree", "verify", "commit"} <= {key[0] for key in engine.runner.graphs.graphs}
    assert any(s.verify_passes < len(s.output_ids) - 1 for s in got)  # drafts were accepted


def test_the_commit_body_is_idempotent_on_a_path_that_skips_nodes(tmp_path):
    """The accepted path 0 -> 2 -> 4 -> 5 skips nodes 1 and 3, so compacting its KV moves column c+2 to c+1
    and c+4 to c+2: done twice, column c+1 would get what the first pass had moved into c+2. The commit
    body runs twice here; the caches and its outputs must be those of one run."""
    tiny_llama(tmp_path, vocab=32, layers=5, hidden=64)
    engine = Engine(str(tmp_path), dtype="fp32", max_batch=2, max_len=256, draft=random_draft(64, 32, draft_vocab=24),
                    spec=SpecConfig(5, 4, 8, adaptive=False))
    decoder = engine.decoder
    g = torch.Generator().manual_seed(0)
    for kv in (engine.runner.kv, decoder.kv):
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        if not kv.shared:
            kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    tokens = torch.tensor([[3, 10, 11, 12, 13, 14, 15, 16]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4, 3, 5]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 4]])
    mask = torch.eye(8, dtype=torch.bool)[None].clone()
    for i in range(1, 8):
        mask[0, i] |= mask[0, parents[0, i]]
    argmax = torch.tensor([[11, 0, 13, 0, 14, 30, 0, 0]])  # accepts nodes 2, 4, 5; node 7 (16) != 30
    aux = torch.randn(1, 8, 3 * 64, generator=g)
    c_t, slots = torch.tensor([20]), torch.tensor([0])

    def run():
        out = decoder.commit_body(tokens, parents, depth, mask, argmax, aux, c_t, slots, 256)
        caches = [t.clone() for kv in (engine.runner.kv, decoder.kv)
                  for t in ((kv.k, kv.v) if not kv.shared else (kv.k,))]
        return [o.clone() for o in out], caches

    once_out, once_caches = run()
    twice_out, twice_caches = run()
    assert once_out[1].tolist() == [3] and once_out[2][0, :4].tolist() == [0, 2, 4, 5]
    assert all(torch.equal(a, b) for a, b in zip(once_out, twice_out))
    assert all(torch.equal(a, b) for a, b in zip(once_caches, twice_caches))
