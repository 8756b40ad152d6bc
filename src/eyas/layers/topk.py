"""The k largest entries of each row, and of each row's log-softmax: torch.topk's meaning, one kernel at
decode for short rows (eyas.kernels.topk; the execution plan's topk_kernel=False keeps torch's)."""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.kernels import enabled


def topk(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries along the last dim, largest first; with log_softmax, of
    torch.log_softmax(x.float(), -1) (fp32 values). Ties may come out in another order than torch.topk's."""
    if enabled(x) and execution_plan.current().topk_kernel:
        from eyas.kernels.topk import fits, topk as fused

        if fits(x, k):
            return fused(x, k, log_softmax)
    return (torch.log_softmax(x.float(), dim=-1) if log_softmax else x).topk(k, dim=-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): the first index of the largest entry (a draft's greedy pick over its vocabulary)."""
    return topk(x, 1)[1][..., 0]
