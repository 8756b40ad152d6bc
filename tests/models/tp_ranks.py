"""The ranks of test_mla_parity's TP=2 check, in a module of their own: a spawned rank imports this one (torch
and eyas), not the test module, whose transformers import took it seconds."""

import torch

from eyas.tensor_parallel import TPContext
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


def decode_logits(model) -> torch.Tensor:
    """Logits of a 6-token prefill's last position and of 3 one-row decode steps after it, at cache slot 1."""
    runner = ModelRunner(model, num_slots=2, max_len=64, device="cpu")
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    out = [model.logits(runner.forward(ids[:, :6], torch.arange(6)[None], [1], [0]).hidden)[:, -1:]]
    for t in range(6, 9):
        out.append(model.logits(runner.forward(ids[:, t:t + 1], torch.tensor([[t]]), [1], [t]).hidden))
    return torch.cat(out, dim=1)


def tp_decode_worker(rank: int, port: int, path: str, out: str):
    """decode_logits on rank `rank` of two, counting the one-row q/k/v + rotary kernel's calls (the parent's
    environment, EYAS_KERNELS included, reaches the spawned rank)."""
    import eyas.kernels.qkv_rotary as qkv_rotary

    torch.set_num_threads(1)
    calls = []
    real = qkv_rotary.norm_qkv_rotary
    qkv_rotary.norm_qkv_rotary = lambda *args: calls.append(1) or real(*args)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = load_model(path, "fp32", "cpu", tp=TPContext(rank=rank, size=2))
    torch.save((decode_logits(model), len(calls)), f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()
