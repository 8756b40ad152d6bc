"""Admission in groups (`admit_batch`): prefill waits until enough requests fit at once, yet nobody starves
and the tokens are those of admitting every request at once."""

import pytest

from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.helpers import tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, vocab=64, layers=2)
    return str(path)


def _run(target_dir, admit_batch):
    eng = Engine(target_dir, dtype="fp32", device="cpu", max_batch=4, max_len=64, admit_batch=admit_batch)
    # Replies of different lengths, so slots free up one at a time.
    seqs = [eng.add([1 + i, 2, 3], SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True)) for i in range(10)]
    prefill_sizes = []
    while eng.has_work():
        before = len(eng.waiting)
        eng.step()
        if len(eng.waiting) < before:
            prefill_sizes.append(before - len(eng.waiting))
    return [s.output_ids for s in seqs], prefill_sizes


def test_grouped_admission_gives_the_same_tokens_with_fewer_prefills(target_dir):
    one, sizes_one = _run(target_dir, 1)
    grouped, sizes_grouped = _run(target_dir, 3)
    assert grouped == one
    assert all(len(o) == 3 + 2 * i for i, o in enumerate(grouped))  # every request ran to its end
    assert sizes_one[0] == sizes_grouped[0] == 4                   # an idle engine admits at once
    assert 1 in sizes_one[1:]                                      # one slot at a time without grouping
    # With grouping, a prefill while others run takes >= 3 requests, or all that are left.
    waiting_left = 10 - 4
    for n in sizes_grouped[1:]:
        assert n >= min(3, waiting_left)
        waiting_left -= n
    assert len(sizes_grouped) < len(sizes_one)
