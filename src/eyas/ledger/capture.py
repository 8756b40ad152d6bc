"""Record a run with everything that determines its result, in two calls from any entry point.

Usage:
    ledger = Ledger()
    run_id = begin_run(ledger, "serve", sys.argv, config, model=args.model, draft=args.draft)
    ...start workers...
    record_workers(ledger, run_id, os.getpid())    # what the workers really got, read from /proc
    ledger.finish_run(run_id, "ok", {"output_tok_s": 94.1})
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.launch.environment import filtered_env, hardware, path_fingerprint, versions
from eyas.ledger.ledger import Ledger
from eyas.launch.procenv import process_tree, read_cmdline, read_environ


def _fingerprint(path: str | None, cache_dir: Path) -> str | None:
    # Hub ids like "meta-llama/Llama-3.1-8B" are not local paths; only what is on disk can be hashed.
    if not path or not Path(path).exists():
        return None
    try:
        return path_fingerprint(path, cache_dir)
    except (OSError, EyasError):  # an unreadable file must not stop the run from being recorded
        return None


def begin_run(ledger: Ledger, kind: str, argv: list[str], config: Any, model: str | None = None,
              draft: str | None = None, environ: dict[str, str] | None = None) -> str:
    """start_run with the captured environment, versions, hardware and weight fingerprints."""
    return ledger.start_run(kind, list(argv), os.getcwd(), filtered_env(environ), config, model, draft,
                            versions=versions(), hardware=hardware(),
                            model_fingerprint=_fingerprint(model, ledger.path.parent),
                            draft_fingerprint=_fingerprint(draft, ledger.path.parent))


def record_workers(ledger: Ledger, run_id: str, root_pid: int) -> int:
    """Store the starting environment of every descendant of `root_pid` as a worker; returns how many."""
    count = 0
    for pid in process_tree(root_pid)[1:]:
        try:
            env = read_environ(pid)
        except OSError:  # exited, or owned by another user
            continue
        ledger.add_worker_env(run_id, f"pid{pid}", filtered_env(env), {"pid": pid, "cmdline": read_cmdline(pid)})
        count += 1
    return count
