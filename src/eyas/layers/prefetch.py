"""Weights a decode step prefetches into L2 on a side stream, beside the kernels that leave memory idle.

EYAS_L2_PREFETCH=bulk|lines turns it on (eyas.kernels.l2_prefetch says what the two modes are): each layer's
output projection is prefetched while its attention runs, and with EYAS_L2_PREFETCH_GATE_UP_MB=N the first N
MB of its gate/up projection while the output projection (then read from L2) runs. Only steps of at most
MAX_ROWS rows on a CUDA device of sm_90 or later prefetch. The side stream's work never writes; the forward
joins it once, at its end (`join`), as a CUDA graph capture requires.
"""

from __future__ import annotations

import os

import torch

MAX_ROWS = 8
_side_streams: dict[int, torch.cuda.Stream] = {}
_forked: set[int] = set()


def mode() -> str | None:
    """The prefetch mode EYAS_L2_PREFETCH asks for, or None (off)."""
    value = os.environ.get("EYAS_L2_PREFETCH", "0")
    if value in ("", "0"):
        return None
    from eyas.kernels.l2_prefetch import MODES

    if value not in MODES:
        raise ValueError(f"EYAS_L2_PREFETCH={value!r}: use 0, {' or '.join(MODES)}")
    return value


def megabytes(name: str) -> int:
    """Bytes from an environment variable given in MB (0 when unset)."""
    value = os.environ.get(name, "0")
    try:
        mb = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of megabytes") from None
    if mb < 0:
        raise ValueError(f"{name}={value!r} is negative")
    return int(mb * 2 ** 20)


def applies(x: torch.Tensor) -> bool:
    """Whether a step with activations x prefetches: on, CUDA sm_90+, at most MAX_ROWS rows."""
    if mode() is None or not x.is_cuda or x.numel() // x.shape[-1] > MAX_ROWS:
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def ahead(weight: torch.Tensor, x: torch.Tensor, nbytes: int | None = None) -> None:
    """Prefetch `weight` (its first nbytes) on the side stream, starting after the work queued so far."""
    if not applies(x):
        return
    from eyas.kernels.l2_prefetch import prefetch_l2

    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    chunk = int(os.environ.get("EYAS_L2_PREFETCH_CHUNK", "32768"))
    with torch.cuda.stream(side):
        prefetch_l2(weight, nbytes, mode(), chunk)
    _forked.add(device)


def join(x: torch.Tensor) -> None:
    """Make the current stream wait for the prefetches forked since the last join (none: nothing to do)."""
    if not x.is_cuda:
        return
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if device in _forked:
        torch.cuda.current_stream(device).wait_stream(_side_streams[device])
        _forked.discard(device)
