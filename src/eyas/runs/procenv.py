"""Read the environment every process of a running server really has, from /proc.

Usage: print(verify_env(server_pid, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}).render())

The lost 94 tok/s came down to NCCL variables set in the launcher that were missing in the tensor-parallel
workers. Looking at the launcher proves nothing; this walks the whole process tree and reads each process's
/proc/PID/environ. That file holds the environment the process was *started* with: later os.environ edits inside
it are invisible, but whatever a parent handed its children (spawn, subprocess env=...) is exactly what shows.
Linux only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyas.runs.table import format_table

_WATCHED = ("NCCL_", "CUDA_", "TORCH_", "EYAS_")


def _parent_pids() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process exited while we were listing
            continue
        # The command name is in parentheses and may itself contain spaces or ')': split after the last one.
        fields = text.rsplit(")", 1)[1].split()
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_pids().items():
        children.setdefault(parent, []).append(child)
    tree, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        tree.append(p)
        queue += sorted(children.get(p, []))
    return tree


def read_environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with. Raises PermissionError/FileNotFoundError when it cannot be read."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    env = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def read_cmdline(pid: int) -> str:
    try:
        return " ".join(a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                        if a)
    except OSError:
        return ""


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
    error: str | None = None  # why /proc/PID/environ could not be read

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
                rows.append([str(p.pid), "-", "-", f"unreadable: {p.error}", p.cmdline[:60]])
            for c in p.checks:
                seen = "(unset)" if c.observed is None else c.observed
                rows.append([str(p.pid), c.key, c.expected, seen if c.ok else f"{seen}  <-- MISMATCH",
                             p.cmdline[:60]])
        verdict = "all processes have the required environment" if self.ok else (
            f"{len(self.mismatches())} mismatch(es) in {len({p.pid for p, _ in self.mismatches()})} process(es)")
        return format_table(["pid", "variable", "expected", "observed", "command"], rows) + "\n" + verdict


def verify_env(root_pid: int, required: dict[str, str]) -> EnvReport:
    """For `root_pid` and every descendant: does its starting environment hold each required value?"""
    processes = []
    for pid in process_tree(root_pid):
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
