"""Tensor-parallel linears that own their sharding and weight loading.

At tp.size == 1 they are plain linears. `load(param, tensor, shard)` receives the full checkpoint
tensor and copies this rank's slice into place; `shard` names a sub-block of a fused weight
(q/k/v of qkv_proj, 0/1 of gate_up_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.tensor_parallel import SINGLE, TPContext
from eyas.errors import EyasError


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes that oneDNN's linear runs on this CPU: fp32 wherever torch has the op, bf16 only where a trial
    call runs (a CPU without bf16 instructions, AVX2 alone, refuses every bf16 shape)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return ()
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        try:
            _onednn_linear(torch.ones(1, 1, 16, dtype=dtype), torch.ones(16, 16, dtype=dtype), None)
        except RuntimeError:
            continue
        runs.append(dtype)
    return tuple(runs)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # torch registers this oneDNN op under a private name only (no public alias).
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001


ONEDNN_DTYPES = _onednn_dtypes()


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias). On the CPU, in fp32 or bf16 (where oneDNN runs it) with no gradient wanted,
    through oneDNN's matmul on the weight as it is (no packed copy): there MKL's GEMV and small-row GEMM are the
    slower kernels on AVX-512 machines, and a verify pass's few rows cost oneDNN little more than one row
    (benchmarks/bench_cpu_peers.py). Elsewhere torch's F.linear."""
    if (x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str):
    """Copy a checkpoint tensor (or this rank's slice of it) into a parameter, refusing a shape mismatch with
    a one-line error that names the weight (`what`)."""
    if dst.shape != src.shape:
        raise EyasError(f"weight {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; `out_sizes` are the full sizes of fused blocks."""

    def __init__(self, in_features: int, out_sizes: dict | list, bias: bool, tp: TPContext = SINGLE):
        super().__init__()
        sizes = out_sizes if isinstance(out_sizes, dict) else dict(enumerate(out_sizes))
        self.tp = tp
        self.local = {k: tp.shard(n, f"output block {k}") for k, n in sizes.items()}
        self.offsets, off = {}, 0
        for k, n in self.local.items():
            self.offsets[k] = off
            off += n
        self.weight = nn.Parameter(torch.empty(off, in_features))
        self.bias = nn.Parameter(torch.empty(off)) if bias else None

    def forward(self, x):
        return dense(x, self.weight, self.bias)

    def load(self, param: str, tensor: torch.Tensor, shard=None):
        key = 0 if shard is None else shard
        n, off = self.local[key], self.offsets[key]
        part = tensor.narrow(0, self.tp.rank * n, n)
        copy_weight(getattr(self, param).data.narrow(0, off, n), part, f"{param}[{key}]")


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, tp.shard(in_features, "input features")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):
        return self.finish(dense(x, self.weight))

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's x_local W_local^T, summed over ranks, plus the bias."""
        y = self.tp.all_reduce(partial)
        return y + self.bias if self.bias is not None else y

    def load(self, param: str, tensor: torch.Tensor, shard=None):
        if param == "bias":
            return copy_weight(self.bias.data, tensor, "bias")
        n = self.weight.shape[1]
        copy_weight(self.weight.data, tensor.narrow(1, self.tp.rank * n, n), "weight")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; each rank looks up its own rows and the results are summed."""

    def __init__(self, vocab: int, dim: int, tp: TPContext = SINGLE):
        super().__init__()
        self.tp = tp
        self.per_rank = tp.shard(vocab, "vocabulary size")
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))

    def forward(self, ids):
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)

    def load(self, param: str, tensor: torch.Tensor, shard=None):
        copy_weight(self.weight.data, tensor.narrow(0, self.start, self.per_rank), "embedding")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with vocabulary rows split across ranks; logits are gathered on every rank."""

    def forward(self, hidden):
        return self.tp.all_gather_last_dim(dense(hidden, self.weight))
