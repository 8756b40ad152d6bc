"""Which rank this training process is: torchrun's environment, or a single process.

Usage: dist_info = init_distributed("cuda")   # reads RANK / WORLD_SIZE / LOCAL_RANK set by torchrun

Every stage runs on every rank: generation and capture split their work by rank, training wraps the
draft in DistributedDataParallel, and the rank-0-only stages (vocab file, export, eval) sit between
barriers. NCCL on GPUs, gloo on CPU (which is how CI runs two ranks).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def close(self):
        """Meet the other ranks, then tear the group down: a rank that exits while another still talks to it
        makes gloo abort that one ("terminate called without an active exception")."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def device(self, device: str) -> str:
        """`cuda` becomes this rank's own GPU."""
        return f"cuda:{self.local_rank}" if device == "cuda" and self.world > 1 else device


def init_distributed(device: str) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        # Generation stages can keep one rank busy far longer than another: a generous timeout.
        dist.init_process_group(backend, timeout=timedelta(hours=2))
    return info


def log(info: DistInfo, message: str):
    """Rank-0 logging: one line per event, not one per GPU."""
    if info.main:
        print(message, file=sys.stderr, flush=True)
