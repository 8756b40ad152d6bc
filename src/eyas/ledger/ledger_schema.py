"""The run ledger's SQLite schema: its migrations, and how a connection to it is opened.

Usage:
    conn = connect(path)       # WAL, busy timeout, autocommit off: every write is one BEGIN IMMEDIATE
    migrate(conn)              # -> the schema version now (LATEST)
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from eyas.errors import EyasError

# Ordered, append-only: a released migration is never edited, a change is a new entry.
MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "first schema: runs and per-worker environments", [
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            kind TEXT NOT NULL,
            status TEXT NOT NULL,
            started_at REAL NOT NULL,
            finished_at REAL,
            argv TEXT NOT NULL,
            cwd TEXT NOT NULL,
            env TEXT NOT NULL,
            config TEXT NOT NULL,
            model TEXT,
            draft TEXT,
            results TEXT NOT NULL DEFAULT '{}')""",
        """CREATE TABLE worker_env (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            worker TEXT NOT NULL,
            env TEXT NOT NULL,
            info TEXT NOT NULL,
            captured_at REAL NOT NULL)""",
    ]),
    # v1 could not tell "slower code" from "slower machine" or "different weights behind the same path".
    (2, "what a run ran on: versions, hardware, host, weight fingerprints; indexes for list and diff", [
        "ALTER TABLE runs ADD COLUMN versions TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE runs ADD COLUMN hardware TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE runs ADD COLUMN host TEXT",
        "ALTER TABLE runs ADD COLUMN model_fingerprint TEXT",
        "ALTER TABLE runs ADD COLUMN draft_fingerprint TEXT",
        "CREATE INDEX runs_kind_started ON runs(kind, started_at)",
        "CREATE INDEX worker_env_run ON worker_env(run_id)",
    ]),
    # A launcher killed with -9 left its run "running" forever: who recorded a run is kept, to tell when it is gone.
    (3, "the process that records each run, so a run whose launcher died can be closed as abandoned", [
        "ALTER TABLE runs ADD COLUMN launcher TEXT NOT NULL DEFAULT '{}'",
    ]),
]
LATEST = MIGRATIONS[-1][0]


def schema_version(conn: sqlite3.Connection) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL,"
                 " description TEXT NOT NULL)")
    return conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]


def migrate(conn: sqlite3.Connection, target: int = LATEST) -> int:
    """Bring the schema up to `target` inside one write transaction, so racing openers migrate exactly once."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        current = schema_version(conn)
        if current > LATEST:
            raise EyasError(f"the run ledger has schema v{current}, newer than this eyas knows (v{LATEST}): "
                            f"upgrade eyas")
        for version, description, statements in MIGRATIONS:
            if current < version <= target:
                for sql in statements:
                    conn.execute(sql)
                conn.execute("INSERT INTO schema_version VALUES (?, ?, ?)", (version, time.time(), description))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return max(current, target)


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: we issue BEGIN IMMEDIATE ourselves; Python's implicit deferred BEGIN would let two
    # writers both read, then deadlock on the upgrade to a write lock, which busy_timeout cannot resolve.
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn
