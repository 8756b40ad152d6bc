"""Tensor-parallel context: which rank this process is and how to talk to the others.

At size 1 every collective is a no-op, so CPU tests run the same model code as TP=N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank: for choices made from a rank's own measurements (its timings),
        which would otherwise differ between ranks and leave their collectives unpaired."""
        if self.size == 1:
            return flag
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([int(flag)], device=device)
        dist.broadcast(t, src=dist.get_global_rank(self.group or dist.group.WORLD, 0), group=self.group)
        return bool(t.item())

    def shard(self, n: int, what: str) -> int:
        """Size of this rank's share of `n` items, refusing uneven splits."""
        if n % self.size:
            from eyas.errors import EyasError

            raise EyasError(f"{what} ({n}) is not divisible by tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TPContext()
