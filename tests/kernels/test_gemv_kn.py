"""The input-major GEMV against torch (Triton's interpreter on the CPU; on a GPU with EYAS_TEST_CUDA=1)."""

import pytest
import torch

from eyas.kernels.gemv_kn import gemv_kn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,n,block_n,block_k,split", [
    (1, 96, 80, 32, 16, 1),   # N not a multiple of the column block
    (1, 100, 64, 32, 16, 3),  # K split three ways, the last part short
    (3, 64, 48, 16, 8, 4),    # several rows, split
    (2, 40, 32, 32, 16, 8),   # more parts asked than K has blocks: fewer run
])
def test_gemv_kn_matches_torch(device, dtype, rows, k, n, block_n, block_k, split):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    wt = (torch.randn(k, n, generator=g) * k ** -0.5).to(device, dtype)
    ref = (x.float() @ wt.float())
    for _ in range(2):  # the second launch reuses the workspace: its ticket counters were reset
        y = gemv_kn(x, wt, block_n=block_n, block_k=block_k, split=split)
        assert y.shape == (rows, n) and y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_gemv_kn_split_is_deterministic(device):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 256, generator=g).to(device)
    wt = torch.randn(256, 64, generator=g).to(device)
    first = gemv_kn(x, wt, block_n=32, block_k=16, split=4)
    assert torch.equal(first, gemv_kn(x, wt, block_n=32, block_k=16, split=4))


def test_gemv_kn_rejects_a_weight_of_the_wrong_width(device):
    with pytest.raises(ValueError, match="does not take"):
        gemv_kn(torch.zeros(1, 8, device=device), torch.zeros(9, 4, device=device))
