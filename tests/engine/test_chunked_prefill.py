"""Prefill in 64-token chunks (what CUDA graphs replay for a server's joins) changes speed, not results."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.runner import GRAPHED_PREFILL_ROWS, GRAPHED_PREFILL_TOKENS, PREFILL_CHUNK
from eyas.layers.sampling import SamplingParams
from tests.helpers import random_draft, tiny_llama

LENGTHS = (7, 64, 65, 150)  # inside one chunk, exactly one, one token over, three chunks with a ragged end


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in LENGTHS]


def engine(path, chunked: bool, spec=None) -> Engine:
    draft = random_draft(64, 64, draft_vocab=48) if spec else None
    eng = Engine(str(path), dtype="fp32", device="cpu", max_batch=4, max_len=256, draft=draft, spec=spec)
    eng.runner.chunked_prefill = chunked
    return eng


def test_chunked_prefill_gives_the_eager_features_and_cache(tmp_path):
    tiny_llama(tmp_path, vocab=64)
    outs = []
    for chunked in (False, True):
        # A draft makes the target capture its features.
        eng = engine(tmp_path, chunked, SpecConfig(3, 1, adaptive=False))
        ps = prompts()
        T = max(LENGTHS)
        ids = torch.tensor([p + [0] * (T - len(p)) for p in ps])
        slots = [eng.runner.kv.allocate() for _ in ps]
        out = eng.runner.prefill(ids, slots)
        cache = [eng.runner.kv.k[:, s, :, :n].clone() for s, n in zip(slots, LENGTHS)]
        outs.append((out, cache))
    (eager, eager_cache), (chunked, chunked_cache) = outs
    assert chunked.hidden.shape == eager.hidden.shape and chunked.aux_hidden.shape == eager.aux_hidden.shape
    for i, n in enumerate(LENGTHS):  # the real tokens of each row; padding is nobody's
        torch.testing.assert_close(chunked.hidden[i, :n], eager.hidden[i, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(chunked.aux_hidden[i, :n], eager.aux_hidden[i, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(chunked_cache[i], eager_cache[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["plain", "chain", "tree"])
def test_chunked_prefill_gives_the_same_tokens(tmp_path, spec):
    tiny_llama(tmp_path, vocab=64)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 20, 30, 25)]
    outs = [[s.output_ids for s in engine(tmp_path, chunked, spec).generate(prompts(), params)]
            for chunked in (False, True)]
    assert outs[0] == outs[1]


class _Graphs:
    def can_run(self, B, T):
        return T <= PREFILL_CHUNK and B <= 64


def test_which_prefills_run_in_graphed_chunks(tmp_path):
    """Joins (a few short prompts) replay graphs; large groups, long prompts and prompts whose last chunk
    would pass the cache's end run eagerly, as does every prefill without CUDA graphs."""
    tiny_llama(tmp_path, vocab=64)
    eng = Engine(str(tmp_path), dtype="fp32", device="cpu", max_batch=4, max_len=256)
    runner = eng.runner
    assert not runner.prefills_in_chunks(1, 10)  # no graphs on the CPU
    runner.graphs = _Graphs()
    assert runner.prefills_in_chunks(1, 10)
    assert runner.prefills_in_chunks(GRAPHED_PREFILL_ROWS, GRAPHED_PREFILL_TOKENS)
    assert not runner.prefills_in_chunks(GRAPHED_PREFILL_ROWS + 1, 10)
    assert not runner.prefills_in_chunks(1, GRAPHED_PREFILL_TOKENS + 1)
    runner.max_len = 100
    assert runner.prefills_in_chunks(1, 64) and not runner.prefills_in_chunks(1, 65)  # 2 chunks = 128 > 100


def test_the_drafts_chunked_prefill_gives_its_eager_states(tmp_path):
    """The draft follows the target's chunks: each prompt's last hidden state and log-probabilities, from
    whichever chunk holds its last token, equal those of one eager pass."""
    tiny_llama(tmp_path, vocab=64)
    outs = []
    for chunked in (False, True):
        eng = engine(tmp_path, chunked, SpecConfig(3, 1, adaptive=False))
        ps = prompts()
        seqs = [eng.add(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in ps]
        for s in seqs:
            s.slot = eng.runner.kv.allocate()
        eng._prefill(seqs)
        outs.append([(s.draft_state.batch_hidden[s.draft_state.row], s.draft_state.batch_scores[s.draft_state.row])
                     for s in seqs])
    for (h0, l0), (h1, l1) in zip(*outs):
        torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_chunked_prefill_of_moe_and_mla_targets(tmp_path, arch):
    """Routed experts see the chunks' padding tokens, and MLA caches one shared latent per token (torch
    attention, not the slot kernel); with a 200-column cache the 150-token prompt's last chunk pads to 192."""
    from tests.models.tiny_moe import save_tiny

    save_tiny(arch, tmp_path, vocab_size=32)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 64, 65, 150)]
    outs = []
    for chunked in (False, True):
        eng = Engine(str(tmp_path), dtype="fp32", max_batch=4, max_len=200, spec=SpecConfig(4, 3, 8, adaptive=False),
                     draft=random_draft(64, 32, draft_vocab=24))
        eng.runner.chunked_prefill = chunked
        outs.append([s.output_ids for s in eng.generate(ps, SamplingParams(max_tokens=20))])
    assert outs[0] == outs[1]
