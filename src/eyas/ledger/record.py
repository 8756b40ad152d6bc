"""One run as the ledger stores it, and the field names (`config.spec_steps`, `env.NCCL_PROTO`) that address it."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from eyas.errors import EyasError

KINDS = ("serve", "launch", "bench", "train", "tune", "generate")
# abandoned: its launcher died (kill -9, a crash, a reboot) before it could finish the run;
# stopped: `eyas remote stop` ended a server whose run was still open.
STATUSES = ("running", "ok", "failed", "interrupted", "abandoned", "stopped")

# Plain columns, addressable as `kind`, `status`, ...; the JSON columns are addressed as `config.X`, `env.X`, ...
COLUMNS = ("kind", "status", "model", "draft", "host", "cwd", "started_at", "finished_at", "model_fingerprint",
           "draft_fingerprint")
JSON_COLUMNS = ("config", "env", "results", "versions", "hardware")
FIELD_HELP = ("kind, status, model, draft, host, or config.X, env.X, results.X, versions.X, hardware.X, "
              "workers.X (any worker's environment)")

_RUN_ID = re.compile(r"^(\d+)(?:-(\d{8}-\d{6}))?$")


def format_run_id(rowid: int, started_at: float) -> str:
    """`42-20250611-153012`: the integer is enough to type, the UTC timestamp makes a stale id fail loudly."""
    return f"{rowid}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(started_at))}"


def parse_run_id(run_id: str | int) -> tuple[int, str | None]:
    m = _RUN_ID.match(str(run_id).strip())
    if not m:
        raise EyasError(f"'{run_id}' is not a run id (expected e.g. 42 or 42-20250611-153012)")
    return int(m.group(1)), m.group(2)


def metric_field(name: str) -> str:
    """A bare metric name means a result: `output_tok_s` is `results.output_tok_s`."""
    return name if "." in name or name in COLUMNS else f"results.{name}"


@dataclass
class WorkerEnv:
    """The environment one worker process really had (read from it, not from its parent)."""

    worker: str
    env: dict[str, str]
    info: dict[str, Any]
    captured_at: float


@dataclass
class RunRecord:
    run_id: str
    kind: str
    status: str
    started_at: float
    finished_at: float | None
    argv: list[str]
    cwd: str
    env: dict[str, str]
    config: dict[str, Any]
    results: dict[str, Any]
    model: str | None = None
    draft: str | None = None
    host: str | None = None
    model_fingerprint: str | None = None
    draft_fingerprint: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    hardware: dict[str, Any] = field(default_factory=dict)
    workers: list[WorkerEnv] = field(default_factory=list)
    launcher: dict[str, Any] = field(default_factory=dict)  # the process that recorded it: pid, host, start time

    def command(self) -> str:
        """The exact shell command that reproduces this run. Redacted secrets are left out: the program inherits
        them from the caller's shell."""
        from eyas.launch.environment import REDACTED
        from eyas.shell.shell import command_line

        return command_line(self.argv, {k: v for k, v in self.env.items() if v != REDACTED})

    def get(self, key: str) -> Any:
        """The value at a field name such as `config.spec_steps` or `results.output_tok_s`; None if absent."""
        head, _, rest = key.partition(".")
        if not rest:
            if head not in COLUMNS and head != "run_id":
                raise EyasError(f"unknown field '{key}': use {FIELD_HELP}")
            return getattr(self, head)
        if head == "workers":
            values = sorted({w.env[rest] for w in self.workers if rest in w.env})
            return ",".join(values) if values else None
        if head not in JSON_COLUMNS:
            raise EyasError(f"unknown field '{key}': use {FIELD_HELP}")
        value: Any = getattr(self, head)
        for part in [rest] if head == "env" else rest.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
