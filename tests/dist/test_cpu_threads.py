"""The CPU thread rule of `eyas serve`'s worker and the demo: the ranks split every core, at least one each."""

from eyas.dist.worker import cpu_thread_count


def test_one_rank_takes_every_core():
    assert cpu_thread_count(2, 1) == 2
    assert cpu_thread_count(16, 1) == 16


def test_ranks_split_the_cores():
    assert cpu_thread_count(16, 4) == 4
    assert cpu_thread_count(7, 2) == 3


def test_every_rank_gets_a_thread():
    assert cpu_thread_count(2, 4) == 1
    assert cpu_thread_count(1, 1) == 1
    assert cpu_thread_count(0, 0) == 1
