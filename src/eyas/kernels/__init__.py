"""Triton kernels for the decode-shaped hot path (fused norms, rotary, activation, slot-cache attention).

Every kernel has a torch reference in eyas.layers that defines its meaning; the layers call a kernel
only when `enabled(tensor)`: the tensor is on a CUDA device, Triton imports, and EYAS_KERNELS is not
"0". The kernel functions themselves launch on any tensor, so the tests run them on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set in tests/kernels/conftest.py before Triton is imported).
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without Triton: the torch reference paths run
    HAVE_TRITON = False


def enabled(t: torch.Tensor) -> bool:
    return HAVE_TRITON and t.is_cuda and os.environ.get("EYAS_KERNELS", "1") != "0"
