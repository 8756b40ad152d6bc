"""Tensor parallelism through the decode kernels: two gloo ranks, each with half the heads, run the one-row
q/k/v + rotary kernel (eyas.kernels.qkv_rotary, in Triton's interpreter) over their shards of the fused
q/k/v weight and their own caches, and give the logits of one process with every head."""

import torch
import torch.multiprocessing as mp

from eyas.dist.launch import free_port
from eyas.models.loader import load_model
from tests.helpers import tiny_llama
from tests.models.tp_ranks import decode_logits, tp_decode_worker


def test_tp2_decode_through_the_qkv_rotary_kernel_equals_tp1(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_KERNELS", "force")
    tiny_llama(tmp_path, vocab=64, layers=2, hidden=128)  # a head dim of 32: the slot-attention kernel's least
    port = free_port()
    mp.spawn(tp_decode_worker, args=(port, str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    want = decode_logits(load_model(tmp_path, "fp32", "cpu"))
    for r in (0, 1):
        got, calls = torch.load(tmp_path / f"rank{r}.pt")
        assert calls == 3 * 2  # 3 one-row steps x 2 layers; the 6-row prefill takes the two kernels
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
