"""`eyas serve`'s run in the ledger: its configuration when it starts, each worker's environment once the workers
report, and a summary when it stops.

Usage:
    rec = ServeRecorder.open(db, sys.argv, config.public(), model, draft, {**os.environ, **config.env}, warn)
    rec.workers([report.to_dict() for report in group.reports])
    rec.execution_plan(info.execution_plan)  # what the workers' engines decided (Engine.execution_plan_summary)
    rec.finish("ok", {"requests_ok": 12, ...})

Recording is best effort: a locked or unwritable ledger is one warning, and the server serves on. A server
killed with -9 leaves its run "running"; the next open of the ledger closes it as abandoned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from eyas.ledger.capture import begin_run
from eyas.launch.environment import filtered_env
from eyas.ledger.ledger import Ledger


class ServeRecorder:
    def __init__(self, ledger: Ledger | None, run_id: str | None, warn: Callable[[str], None]):
        self.ledger, self.run_id, self.warn = ledger, run_id, warn
        self.started = time.monotonic()
        self.noted: dict[str, Any] = {}  # results known while it runs, kept in the finished run's results too

    @classmethod
    def open(cls, db: str | None, argv: list[str], config: dict[str, Any], model: str | None, draft: str | None,
             environ: dict[str, str], requested: dict[str, str], warn: Callable[[str], None]) -> ServeRecorder:
        try:
            ledger = Ledger(db)
            run_id = begin_run(ledger, "serve", argv, config, model=model, draft=draft,
                               environ={**filtered_env(environ), **requested})
        except Exception as e:  # the ledger must never cost the server
            warn(f"this serve is not recorded in the run ledger: {e}")
            return cls(None, None, warn)
        return cls(ledger, run_id, warn)

    def _guard(self, what: str, action: Callable[[], None]) -> None:
        if self.run_id is None:
            return
        try:
            action()
        except Exception as e:
            self.warn(f"run {self.run_id}: could not record {what}: {e}")

    def workers(self, reports: list[dict]) -> None:
        """Each worker's own report of its environment (read inside the worker, so setproctitle cannot hide it)."""
        def add() -> None:
            for r in reports:
                env = {**r.get("variables", {}), **{k: v for k, v in r.get("requested", {}).items() if v is not None}}
                info = {k: r.get(k) for k in ("rank", "pid", "host", "device", "torch", "nccl")}
                self.ledger.add_worker_env(self.run_id, f"rank{r.get('rank')}", env,
                                           {**info, "env_source": "worker report"})
        self._guard("the workers' environments", add)

    def execution_plan(self, summary: dict) -> None:
        """The engines' execution plan and the paths it implies, in the run's results from now on."""
        self.noted["execution_plan"] = summary
        self._guard("the execution plan", lambda: self.ledger.note_running(self.run_id, self.noted))

    def finish(self, status: str, results: dict[str, Any]) -> None:
        summary = {"uptime_s": round(time.monotonic() - self.started, 1), **self.noted, **results}
        self._guard("how it ended", lambda: self.ledger.finish_run(self.run_id, status, summary))
        if self.ledger is not None:
            self.ledger.close()
        self.ledger = self.run_id = None
