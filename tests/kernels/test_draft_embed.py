"""The draft-id embedding kernel against the gather, add and lookup it replaces (Triton's interpreter on the
CPU; on a GPU with EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas.kernels.draft_embed import draft_embed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_target_ids_rows(device, dtype):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 24, generator=g).to(device, dtype)
    d2t = torch.randint(0, 30, (20,), generator=g).to(device)
    ids = torch.randint(0, 20, (3, 4), generator=g).to(device)
    out = draft_embed(ids, d2t, table)
    assert out.shape == (3, 4, 24) and out.dtype == dtype
    assert torch.equal(out, table[ids + d2t[ids]])
    assert draft_embed(ids[:0], d2t, table).shape == (0, 4, 24)


def test_int32_ids_are_refused(device):
    with pytest.raises(ValueError, match="int64"):
        draft_embed(torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(4, dtype=torch.long,
                                                                                   device=device),
                    torch.zeros(4, 8, device=device))
