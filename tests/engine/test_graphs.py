"""CUDA graphs change speed, not tokens: graph replay equals eager execution (runs where CUDA is present)."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft, tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["plain", "chain", "tree"])
def test_graph_replay_equals_eager(tmp_path, spec):
    tiny_llama(tmp_path, vocab=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (7, 19, 3)]
    params = [SamplingParams(max_tokens=n) for n in (40, 25, 40)]
    outs = []
    for graphs in (False, True):
        draft = random_draft(64, 64, draft_vocab=48) if spec else None
        engine = Engine(str(tmp_path), dtype="fp32", device="cuda", max_batch=4, max_len=256, draft=draft, spec=spec,
                        cuda_graphs=graphs)
        outs.append([(s.output_ids, s.verify_passes) for s in engine.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_graphs_accept_what_eager_accepts_across_the_long_row_bucket(tmp_path, spec):
    """Rows that pass 512 columns switch every pass to long-row graphs, the verify pass and the draft's at
    slightly different lengths; a draft graph captured after the verify graph once kept its drafted tokens
    in memory the verify replay overwrote, which lost acceptance but no tokens. Same tokens and the same
    number of verify passes with graphs as without."""
    from tests.server.tiny import predictable_pair

    target, draft = predictable_pair(tmp_path / "target", tmp_path / "draft")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (500, 470)]
    outs = []
    for graphs in (False, True):
        engine = Engine(str(target), dtype="fp32", device="cuda", max_batch=2, max_len=1024, draft=str(draft),
                        spec=spec, cuda_graphs=graphs)
        seqs = engine.generate(prompts, SamplingParams(max_tokens=80, ignore_eos=True))
        outs.append([(s.output_ids, s.verify_passes) for s in seqs])
    assert outs[0] == outs[1]
    assert all(passes < 60 for _, passes in outs[1])  # drafts were accepted


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=True)], ids=["plain", "adaptive"])
def test_warm_up_captures_every_bucket_up_front(tmp_path, spec):
    """After warm_up, batches of any size (speculating or not) replay graphs without capturing new ones."""
    tiny_llama(tmp_path, vocab=64)
    draft = random_draft(64, 64, draft_vocab=48) if spec else None
    engine = Engine(str(tmp_path), dtype="fp32", device="cuda", max_batch=8, max_len=256, draft=draft, spec=spec)
    assert engine.warm_up() > 0
    graphs = engine.runner.graphs
    count = len(graphs.graphs)
    for n in (1, 3, 8):
        engine.generate([[1, 2, 3]] * n, SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(graphs.graphs) == count
