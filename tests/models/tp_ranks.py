"""The ranks of test_mla_parity's TP=2 check, in a module of their own: a spawned rank imports this one (torch
and eyas), not the test module, whose transformers import took it seconds."""

import torch

from eyas.dist.parallel import TPContext
from eyas.engine.runner import ModelRunner
from eyas.models.loader import load_model


def tp_worker(rank: int, port: int, path: str, out: str):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = load_model(path, "fp32", "cpu", tp=TPContext(rank=rank, size=2))
    torch.save(logits(model), f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def logits(model):
    runner = ModelRunner(model, num_slots=2, max_len=64, device="cpu")
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    first = model.logits(runner.forward(ids[:, :20], torch.arange(20)[None], [1], [0]).hidden)
    rest = model.logits(runner.forward(ids[:, 20:], torch.arange(20, 24)[None], [1], [20]).hidden)
    return torch.cat([first, rest], dim=1)
