"""The chain-acceptance kernel against accept_greedy_chain's torch ops (Triton's interpreter on the CPU; on a
GPU with EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas.layers.draft_tree import accept_greedy_chain
from eyas.kernels.chain_accept import chain_accept


def _chains(L: int, device):
    """One row per accepted count 0..L-1: the target's picks equal the drafted tokens up to there, then differ."""
    g = torch.Generator().manual_seed(L)
    tokens = torch.randint(0, 50, (L, L), generator=g)
    argmax = torch.randint(50, 100, (L, L), generator=g)  # never a drafted token
    for row in range(L):
        argmax[row, :row] = tokens[row, 1:row + 1]
    return tokens.to(device), argmax.to(device)


@pytest.mark.parametrize("L", [1, 2, 4, 6])
def test_chain_accept_matches_the_torch_ops(device, monkeypatch, L):
    monkeypatch.setenv("EYAS_KERNELS", "0")
    tokens, argmax = _chains(L, device)
    got = chain_accept(tokens, argmax)
    want = accept_greedy_chain(tokens, argmax)
    assert got[1].tolist() == list(range(L))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.long and torch.equal(a, b)


def test_the_switch_sends_chains_to_the_kernel(device, monkeypatch):
    import eyas.kernels.chain_accept as kernel
    from eyas import execution_plan

    tokens, argmax = _chains(4, device)
    calls = []
    monkeypatch.setattr(kernel, "chain_accept", lambda *a, _f=kernel.chain_accept: calls.append(1) or _f(*a))
    monkeypatch.setenv("EYAS_KERNELS", "force")
    with execution_plan.using(accept_kernel=False):
        off = accept_greedy_chain(tokens, argmax)
    assert not calls
    on = accept_greedy_chain(tokens, argmax)
    assert calls and all(torch.equal(a, b) for a, b in zip(on, off))


def test_strided_inputs_give_row_major_outputs(device, monkeypatch):
    """Column-major inputs (a transposed copy) are read as they lie; the outputs are plain [B, L] rows."""
    monkeypatch.setenv("EYAS_KERNELS", "0")
    tokens, argmax = _chains(4, device)
    t_cm, a_cm = tokens.t().contiguous().t(), argmax.t().contiguous().t()
    for a, b in zip(chain_accept(t_cm, a_cm), accept_greedy_chain(tokens, argmax)):
        assert a.is_contiguous() and torch.equal(a, b)


def test_mismatched_inputs_are_refused(device):
    with pytest.raises(ValueError, match="int64"):
        chain_accept(torch.zeros(2, 3, dtype=torch.long, device=device), torch.zeros(2, 4, dtype=torch.long,
                                                                                         device=device))
