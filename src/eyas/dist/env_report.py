"""What environment each worker really received, and the check that it is what was asked for.

A tensor-parallel run once lost its speed because NCCL variables set in the launcher never reached the
workers. So every worker reports, at start-up, the value it observes for each `--env` key plus every
variable in the families that steer the collectives and the runtime; the server refuses to start when a
requested value is missing or different in any worker.

Test hook: EYAS_TEST_DROP_ENV_IN_RANK="KEY:RANK" makes worker RANK delete KEY from its environment
before it reports, so a test can prove the check catches a variable that did not arrive.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import asdict, dataclass, field

from eyas.options import get as option
from eyas.table import clip, format_table

PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "EYAS_")
EXTRA = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # thread counts change CPU timings as much as NCCL knobs do
TEST_HOOK = "EYAS_TEST_DROP_ENV_IN_RANK"


@dataclass
class EnvReport:
    rank: int
    pid: int
    host: str
    device: str
    torch: str
    nccl: str | None                     # torch.cuda.nccl.version() when the worker runs on CUDA
    requested: dict[str, str | None]     # every --env key -> the value this worker observes (None: unset)
    variables: dict[str, str] = field(default_factory=dict)
    python: str = platform.python_version()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EnvReport":
        return cls(**d)


def apply_test_hook(rank: int) -> None:
    spec = option(TEST_HOOK)
    if not spec:
        return
    key, _, target = spec.rpartition(":")
    if key and target.strip() == str(rank):
        os.environ.pop(key, None)


def watched(env) -> dict[str, str]:
    return {k: env[k] for k in sorted(env) if k.startswith(PREFIXES) or k in EXTRA}


def collect(rank: int, device: str, requested_keys: list[str]) -> EnvReport:
    """This process's report; reads os.environ as it is now, i.e. what getenv() in NCCL or CUDA will see."""
    import torch

    nccl = None
    if device.startswith("cuda") and torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return EnvReport(rank=rank, pid=os.getpid(), host=socket.gethostname(), device=device, torch=torch.__version__,
                     nccl=nccl, requested={k: os.environ.get(k) for k in requested_keys}, variables=watched(os.environ))


def mismatches(reports: list[EnvReport], expected: dict[str, str]) -> list[str]:
    """One line per (key, worker) whose observed value differs from the requested one."""
    problems = []
    for r in sorted(reports, key=lambda r: r.rank):
        for key, want in expected.items():
            got = r.requested.get(key)
            if got != want:
                seen = "unset" if got is None else f"{got!r}"
                problems.append(f"--env {key}={want}: worker {r.rank} (pid {r.pid}) has {key} {seen}")
    return problems


def table(reports: list[EnvReport], requested: list[str]) -> str:
    """Variables down, workers across; requested keys are marked with '*'."""
    reports = sorted(reports, key=lambda r: r.rank)
    headers = ["variable"] + [f"worker {r.rank}" for r in reports]
    rows = [["pid"] + [str(r.pid) for r in reports],
            ["host"] + [r.host for r in reports],
            ["device"] + [r.device for r in reports],
            ["torch"] + [r.torch for r in reports],
            ["nccl"] + [r.nccl or "-" for r in reports]]
    names = list(requested) + sorted({k for r in reports for k in r.variables} - set(requested))
    for name in names:
        values = [r.requested.get(name) if name in r.requested else r.variables.get(name) for r in reports]
        cells = [clip("(unset)" if v is None else v) for v in values]
        rows.append([name + (" *" if name in requested else "")] + cells)
    return format_table(headers, rows)
