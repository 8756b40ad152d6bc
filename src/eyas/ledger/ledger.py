"""The run ledger: every serve/bench/train run, with what it ran with and what it measured, in one SQLite file.

Usage:
    ledger = Ledger()                      # $EYAS_HOME/runs.db
    run_id = ledger.start_run("bench", sys.argv, os.getcwd(), filtered_env(), {"spec_steps": 2})
    ledger.finish_run(run_id, "ok", {"output_tok_s": 94.1})
    ledger.best("output_tok_s", {"env.NCCL_PROTO": "LL"})

Why SQLite in WAL mode: several processes (a server, a benchmark, a tuning sweep) write at once, and a run killed
with SIGKILL must never cost the runs before it. Every write is one IMMEDIATE transaction; a commit in WAL mode is
on disk in the log before it returns, so a killed writer leaves at most its own unfinished transaction behind,
which SQLite rolls back on the next open. synchronous=NORMAL only risks the last commits on power loss, not on a
process crash, and never corrupts the file. The schema and its migrations are in ledger_schema.py; how a run
whose launcher died is told apart, in run_state.py.
"""

from __future__ import annotations

import json
import math
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.ledger.ledger_schema import connect, migrate
from eyas.ledger.record import (
    COLUMNS,
    FIELD_HELP,
    JSON_COLUMNS,
    KINDS,
    STATUSES,
    RunRecord,
    WorkerEnv,
    format_run_id,
    metric_field,
    parse_run_id,
)
from eyas.ledger.run_state import launcher_gone, launcher_identity, server_still_running
from eyas.paths import eyas_home


def _clean(value: Any) -> Any:
    """JSON that SQLite's json_extract accepts: NaN/inf become null, dataclasses and paths become plain data."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(_clean(value), allow_nan=False, sort_keys=True)


def _json_path(parts: list[str]) -> str:
    return "$" + "".join('."' + p.replace('"', '\\"') + '"' for p in parts)


def field_sql(key: str) -> tuple[str, list[Any]]:
    """SQL expression (and its parameters) for a field name like `kind` or `config.spec_steps`."""
    head, _, rest = key.partition(".")
    if not rest and head in COLUMNS:
        return head, []
    if rest and head in JSON_COLUMNS:
        return f"json_extract({head}, ?)", [_json_path([rest] if head == "env" else rest.split("."))]
    if rest and head == "workers":
        return ("(SELECT json_extract(w.env, ?) FROM worker_env w WHERE w.run_id = runs.id AND "
                "json_extract(w.env, ?) IS NOT NULL LIMIT 1)"), [_json_path([rest])] * 2
    raise EyasError(f"unknown field '{key}': use {FIELD_HELP}")


def _typed(value: str) -> Any:
    """The JSON reading of a --where value, so `config.spec_steps=2` matches the integer 2."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return int(parsed) if isinstance(parsed, bool) else parsed if isinstance(parsed, (int, float)) else value


def ledger_path(path: str | Path | None = None) -> Path:
    """The ledger's file: `path`, else runs.db in $EYAS_HOME."""
    return Path(path) if path else eyas_home() / "runs.db"


def _stays_empty(path: Path) -> bool:
    """An existing file of 0 bytes: a mistyped --db (a log, a fresh `touch`), never a ledger to initialise.

    A ledger another process is creating is 0 bytes only until its first write (the WAL header, within
    microseconds), so a file is called empty only when it still is a moment later.
    """
    for _ in range(3):
        try:
            if not path.is_file() or path.stat().st_size:
                return False
        except OSError:
            return False
        time.sleep(0.05)
    return True


class Ledger:
    def __init__(self, path: str | Path | None = None):
        self.path = ledger_path(path)
        if self.path.is_dir():
            raise EyasError(f"the run ledger {self.path} is a directory, not a file")
        if _stays_empty(self.path):
            raise EyasError(f"{self.path} is an empty file, not a run ledger: give the ledger's path (or delete the "
                            f"empty file to start a new ledger there)")
        try:
            self.conn = connect(self.path)
            migrate(self.conn)
            self.settle_abandoned()
        except sqlite3.DatabaseError as e:  # not an SQLite file (sqlite3 leaves it as it was), or unreadable
            raise EyasError(f"cannot open the run ledger {self.path}: {e}") from None
        except OSError as e:  # its folder cannot be created
            above_is_file = isinstance(e, (FileExistsError, NotADirectoryError))
            why = "a folder above it is a regular file" if above_is_file else e.strerror or e
            raise EyasError(f"cannot create the run ledger {self.path}: {why}") from None

    @classmethod
    def existing(cls, path: str | Path | None = None) -> "Ledger":
        """The ledger at `path` for looking runs up: one that does not exist is an error,
        not a new empty ledger in a mistyped location."""
        path = ledger_path(path)
        if not path.exists():
            raise EyasError(f"no runs recorded yet: {path} does not exist")
        return cls(path)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def start_run(self, kind: str, argv: list[str], cwd: str, env: dict[str, str], config: Any,
                  model: str | None = None, draft: str | None = None, *, versions: dict | None = None,
                  hardware: dict | None = None, model_fingerprint: str | None = None,
                  draft_fingerprint: str | None = None, host: str | None = None) -> str:
        """Record a run as "running" and return its id; call finish_run when it ends."""
        if kind not in KINDS:
            raise EyasError(f"unknown run kind '{kind}': expected one of {', '.join(KINDS)}")
        started = time.time()
        with self._write() as c:
            cur = c.execute(
                "INSERT INTO runs (kind, status, started_at, argv, cwd, env, config, model, draft, versions, "
                "hardware, host, model_fingerprint, draft_fingerprint) VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, "
                "?, ?, ?, ?, ?)",
                (kind, started, _dumps(list(argv)), str(cwd), _dumps(env), _dumps(config or {}), model, draft,
                 _dumps(versions or {}), _dumps(hardware or {}), host or socket.gethostname(), model_fingerprint,
                 draft_fingerprint))
            c.execute("UPDATE runs SET launcher = ? WHERE id = ?", (_dumps(launcher_identity()), cur.lastrowid))
        return format_run_id(cur.lastrowid, started)

    def settle_abandoned(self) -> list[str]:
        """Close every running run whose launcher on this machine is gone as "abandoned", noting whether its
        server still runs; returns their ids. Called on every open, so no run stays "running" forever."""
        rows = self.conn.execute("SELECT id, started_at, kind, launcher, config, results FROM runs WHERE status = "
                                 "'running'").fetchall()
        closed = []
        for rowid, started, kind, launcher, config, results in rows:
            launcher = json.loads(launcher)
            if not launcher_gone(launcher):
                continue
            facts = json.loads(results)
            facts["abandoned"] = f"its launcher (pid {launcher['pid']} on {launcher['hostname']}) is gone"
            if kind in ("serve", "launch", "tune"):  # the kinds that start a server
                facts["server_still_running"] = server_still_running(kind, json.loads(config), facts)
            try:
                with self._write() as c:
                    c.execute("UPDATE runs SET status = 'abandoned', finished_at = ?, results = ? WHERE id = ? AND "
                              "status = 'running'", (time.time(), _dumps(facts), rowid))
            except sqlite3.OperationalError:  # a read-only ledger: leave it as it is
                return closed
            closed.append(format_run_id(rowid, started))
        return closed

    def note_running(self, run_id: str | int, results: dict) -> None:
        """Store what is known so far (e.g. the server's pid) in a run that is still running."""
        rowid = self._rowid(run_id)
        with self._write() as c:
            c.execute("UPDATE runs SET results = ? WHERE id = ? AND status = 'running'", (_dumps(results), rowid))

    def record_stop(self, run_id: str | int, facts: dict) -> str:
        """`eyas remote stop` ended the run's server: a run still open (running, abandoned) becomes "stopped";
        a finished one keeps its status. `facts` joins its results either way. Returns the run's status."""
        rowid = self._rowid(run_id)
        with self._write() as c:
            status, results = c.execute("SELECT status, results FROM runs WHERE id = ?", (rowid,)).fetchone()
            new = "stopped" if status in ("running", "abandoned") else status
            c.execute("UPDATE runs SET status = ?, finished_at = COALESCE(finished_at, ?), results = ? WHERE id = ?",
                      (new, time.time(), _dumps({**json.loads(results), **facts}), rowid))
        return new

    def _rowid(self, run_id: str | int) -> int:
        rowid, stamp = parse_run_id(run_id)
        row = self.conn.execute("SELECT started_at FROM runs WHERE id = ?", (rowid,)).fetchone()
        if row is None or (stamp and format_run_id(rowid, row[0]) != f"{rowid}-{stamp}"):
            raise EyasError(f"no run '{run_id}' in {self.path}")
        return rowid

    def add_worker_env(self, run_id: str | int, worker: str, env: dict[str, str], info: dict | None = None) -> None:
        rowid = self._rowid(run_id)
        with self._write() as c:
            c.execute("INSERT INTO worker_env (run_id, worker, env, info, captured_at) VALUES (?, ?, ?, ?, ?)",
                      (rowid, worker, _dumps(env), _dumps(info or {}), time.time()))

    def finish_run(self, run_id: str | int, status: str, results: dict | None = None) -> None:
        """Close a running run exactly once; results of a finished run are never overwritten."""
        if status not in STATUSES or status == "running":
            raise EyasError(f"unknown final status '{status}': expected ok, failed, interrupted, abandoned or "
                            f"stopped")
        rowid = self._rowid(run_id)
        with self._write() as c:
            cur = c.execute("UPDATE runs SET status = ?, finished_at = ?, results = ? WHERE id = ? AND "
                            "status = 'running'", (status, time.time(), _dumps(results or {}), rowid))
            if cur.rowcount != 1:
                raise EyasError(f"run '{run_id}' has already finished")

    def get(self, run_id: str | int) -> RunRecord:
        return self._select("WHERE id = ?", [self._rowid(run_id)])[0]

    def list(self, where: dict[str, str] | None = None, sort: str | None = None, limit: int | None = None,
             descending: bool = True) -> list[RunRecord]:
        """Runs matching every `where` field (e.g. {"env.NCCL_PROTO": "LL"}), newest first or by `sort`.

        `sort` is a field or a bare result name; runs without it come last. descending=False: oldest/lowest first.
        """
        clause, params = self._where(where)
        order = "id DESC" if descending else "id ASC"
        if sort:
            expr, sort_params = field_sql(metric_field(sort))
            order = f"({expr}) IS NULL, ({expr}) {'DESC' if descending else 'ASC'}, id DESC"
            params += sort_params * 2
        sql = f"{clause} ORDER BY {order}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return self._select(sql, params)

    def best(self, metric: str, where: dict[str, str] | None = None,
             higher_is_better: bool = True) -> RunRecord | None:
        """The finished ("ok", unless `where` says otherwise) run with the best numeric value of `metric`."""
        where = dict(where or {})
        where.setdefault("status", "ok")
        clause, params = self._where(where)
        expr, p = field_sql(metric_field(metric))
        clause += f" AND typeof({expr}) IN ('integer', 'real')"
        params += p
        runs = self._select(f"{clause} ORDER BY ({expr}) {'DESC' if higher_is_better else 'ASC'}, id DESC "
                             f"LIMIT 1", params + p)
        return runs[0] if runs else None

    def _where(self, where: dict[str, str] | None) -> tuple[str, list[Any]]:
        parts, params = ["1 = 1"], []
        for key, value in (where or {}).items():
            expr, p = field_sql(key)
            if key.partition(".")[2]:  # JSON: match the text form or the typed form ("2" and 2, "true" and 1)
                parts.append(f"(CAST(({expr}) AS TEXT) = ? OR ({expr}) = ?)")
                params += p + [value] + p + [_typed(value)]
            else:
                parts.append(f"{expr} = ?")
                params.append(value)
        return "WHERE " + " AND ".join(parts), params

    def _select(self, clause: str, params: list[Any]) -> list[RunRecord]:
        cols = ("id, kind, status, started_at, finished_at, argv, cwd, env, config, results, model, draft, host, "
                "model_fingerprint, draft_fingerprint, versions, hardware, launcher")
        rows = self.conn.execute(f"SELECT {cols} FROM runs {clause}", params).fetchall()
        workers: dict[int, list[WorkerEnv]] = {}
        ids = [r[0] for r in rows]
        for start in range(0, len(ids), 500):  # stay under SQLite's bound-parameter limit
            chunk = ids[start:start + 500]
            for rid, worker, env, info, at in self.conn.execute(
                    f"SELECT run_id, worker, env, info, captured_at FROM worker_env WHERE run_id IN "
                    f"({','.join('?' * len(chunk))}) ORDER BY id", chunk):
                workers.setdefault(rid, []).append(WorkerEnv(worker, json.loads(env), json.loads(info), at))
        return [RunRecord(run_id=format_run_id(r[0], r[3]), kind=r[1], status=r[2], started_at=r[3],
                          finished_at=r[4], argv=json.loads(r[5]), cwd=r[6], env=json.loads(r[7]),
                          config=json.loads(r[8]), results=json.loads(r[9]), model=r[10], draft=r[11], host=r[12],
                          model_fingerprint=r[13], draft_fingerprint=r[14], versions=json.loads(r[15]),
                          hardware=json.loads(r[16]), workers=workers.get(r[0], []),
                          launcher=json.loads(r[17])) for r in rows]

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
