"""Read the environment every process of a running server really has, from /proc.

Usage: print(verify_env(server_pid, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}).render())

The lost 94 tok/s came down to NCCL variables set in the launcher that were missing in the tensor-parallel
workers. Looking at the launcher proves nothing; this walks the whole process tree and reads each process's
/proc/PID/environ. That file holds the environment the process was *started* with: later os.environ edits inside
it are invisible, but whatever a parent handed its children (spawn, subprocess env=...) is exactly what shows.
A process that retitled itself (setproctitle) may have overwritten that memory: it is then reported as
unreadable, never as missing every variable (eyas.launch.procprobe). Linux only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyas.launch import procprobe
from eyas.table import format_table

_WATCHED = ("NCCL_", "CUDA_", "TORCH_", "EYAS_")


class EnvironUnreadable(OSError):
    """/proc/PID/environ no longer holds an environment (a retitled process reused its memory)."""


def process_tree(pid: int) -> list[int]:
    """`pid` and all its live descendants, parents before children."""
    return procprobe.tree(pid)


def read_environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with. Raises FileNotFoundError/PermissionError when it cannot be read,
    EnvironUnreadable when its memory now holds something else (a setproctitle title)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    env, problem = procprobe.parse_environ(raw)
    if env is None:
        raise EnvironUnreadable(0, problem)
    return env


def read_cmdline(pid: int) -> str:
    return procprobe.cmdline(pid)


@dataclass
class EnvCheck:
    key: str
    expected: str
    observed: str | None  # None: not set in this process

    @property
    def ok(self) -> bool:
        return self.observed == self.expected


@dataclass
class ProcessEnv:
    pid: int
    cmdline: str
    checks: list[EnvCheck] = field(default_factory=list)
    observed: dict[str, str] = field(default_factory=dict)  # its NCCL_/CUDA_/TORCH_/EYAS_ variables
    error: str | None = None  # why its environment could not be read (never read as "all unset")
    source: str = "proc"  # "proc" (/proc/PID/environ) or "snapshot" (written by the process at start)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)


@dataclass
class EnvReport:
    root_pid: int
    required: dict[str, str]
    processes: list[ProcessEnv]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.processes)

    def mismatches(self) -> list[tuple[ProcessEnv, EnvCheck]]:
        return [(p, c) for p in self.processes for c in p.checks if not c.ok]

    def render(self) -> str:
        rows = []
        for p in self.processes:
            if p.error:
                rows.append([str(p.pid), "-", "-", f"unreadable: {p.error}", "-", p.cmdline[:60]])
            for c in p.checks:
                seen = "(unset)" if c.observed is None else c.observed
                rows.append([str(p.pid), c.key, c.expected, seen if c.ok else f"{seen}  <-- MISMATCH", p.source,
                             p.cmdline[:60]])
        verdict = "all processes have the required environment" if self.ok else (
            f"{len(self.mismatches())} mismatch(es) in {len({p.pid for p, _ in self.mismatches()})} process(es)")
        return format_table(["pid", "variable", "expected", "observed", "read from", "command"], rows) + "\n" + verdict


def verify_env(root_pid: int, required: dict[str, str]) -> EnvReport:
    """For `root_pid` and every descendant: does its starting environment hold each required value?"""
    processes = []
    for pid in process_tree(root_pid) or [root_pid]:  # a root that is gone is reported, not skipped
        proc = ProcessEnv(pid, read_cmdline(pid))
        try:
            env = read_environ(pid)
        except OSError as e:
            proc.error = e.strerror or type(e).__name__
            processes.append(proc)
            continue
        proc.checks = [EnvCheck(k, v, env.get(k)) for k, v in required.items()]
        proc.observed = {k: v for k, v in sorted(env.items()) if k.startswith(_WATCHED)}
        processes.append(proc)
    return EnvReport(root_pid, dict(required), processes)
