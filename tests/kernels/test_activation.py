"""The fused SiLU-and-mul kernel against torch's `gate, up = x.chunk(2, -1); F.silu(gate) * up`.

What is asserted: in bf16 the kernel rounds where torch does (silu to bf16, then the product), so at most
0.1% of the elements may differ (a last-bit difference in exp flips a rare rounding: none on the CPU
interpreter, possible on a GPU, whose Triton exp is the fast approximate one), each by at most 2^-6 relative
(two ulps: one ulp of silu, times up). Skipping the rounding of silu changes far more elements than that.
In fp32 only exp differs, so the check is 1e-5 relative (the GPU's approximate exp loses up to about 1e-6
for the |gate| of these inputs; the CPU interpreter is within 4 ulps).
"""

import pytest
import torch
import torch.nn.functional as F

from eyas.kernels.activation import silu_mul


def gate_up_rows(shape, dtype, device):
    g = torch.Generator().manual_seed(0)
    return (4 * torch.randn(shape, generator=g)).to(device, dtype)  # gate over silu's whole curve


def reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def assert_silu_mul_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    else:
        assert (out != ref).float().mean().item() <= 1e-3
        torch.testing.assert_close(out, ref, rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 2 * 1536), (1, 2 * 96)])  # 1536 spans two column blocks, one partial
def test_silu_mul_matches_reference(device, dtype, shape):
    gate_up = gate_up_rows(shape, dtype, device)
    assert_silu_mul_close(silu_mul(gate_up), reference(gate_up))


def test_silu_mul_reads_strided_rows(device):
    """Rows that are a slice of a wider tensor are read in place with their row stride."""
    gate_up = gate_up_rows((5, 2 * 512 + 64), torch.bfloat16, device)[:, : 2 * 512]
    assert not gate_up.is_contiguous()
    assert_silu_mul_close(silu_mul(gate_up), reference(gate_up))
