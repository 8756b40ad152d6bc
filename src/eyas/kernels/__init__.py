"""Triton kernels for the decode-shaped hot path (fused norms, rotary, activation, slot-cache attention, top-k,
the draft's embedding lookup).

Every kernel has a torch reference in eyas.layers that defines its meaning; the layers call a kernel
only when `enabled(*tensors)`: the tensors are on a CUDA device, none needs a gradient (these kernels have
no backward: training keeps the torch paths), Triton imports, and EYAS_KERNELS is not "0". The exceptions,
which have their own backward, are training's loss (soft_ce, dispatched by eyas.train.soft_ce), its
attention over the unrolled TTT steps (ttt_attention, dispatched by eyas.train.ttt) and RMSNorm's
rms_norm_train / rms_norm_backward (dispatched by eyas.layers.norm when a norm needs a gradient). The kernel
functions themselves launch on any tensor, so the tests run them on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py before any kernel module is imported).
"""

from __future__ import annotations

import torch

from eyas.options import get as option

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without Triton: the torch reference paths run
    HAVE_TRITON = False


def switched_on(x: torch.Tensor) -> bool:
    """Whether kernels may run on x's device. EYAS_KERNELS: "1" (default) on CUDA, "0" never, "force" on any
    device (CPU tests via the interpreter)."""
    mode = option("EYAS_KERNELS") or "1"
    return HAVE_TRITON and mode != "0" and (x.is_cuda or mode == "force")


def _wants_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def enabled(*tensors: torch.Tensor) -> bool:
    """switched_on for the kernels without a backward: also, no tensor needs a gradient."""
    return switched_on(tensors[0]) and not _wants_grad(tensors)


def enabled_with_grad(*tensors: torch.Tensor) -> bool:
    """switched_on for a kernel pair with a backward (training's norms and rotary), when a gradient is wanted."""
    return switched_on(tensors[0]) and _wants_grad(tensors)
