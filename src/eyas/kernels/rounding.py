"""Rounding an fp32 value to a narrower float dtype, as torch rounds each elementwise op's result.

The fused kernels reproduce torch op by op: compute in fp32, round to the tensor dtype where torch would
store an intermediate. A plain `.to(tl.bfloat16)` rounds to nearest-even on a GPU, but Triton's CPU
interpreter (which the tests run) truncates fp32 to bf16; rounding the bits here instead gives the same,
torch-identical result on both, for a few integer ops per element.
"""

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """fp32 `x` rounded to nearest-even at `dtype`'s precision, still held in fp32 (so exact in `dtype`)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN would carry into the sign bit
    else:
        y = x.to(dtype).to(tl.float32)
    return y
