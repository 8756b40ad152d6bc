"""Run-to-run spread: how much one configuration's result moves between repeats, from the ledger itself.

Usage: spread = measured_spread(run, history, "output_tok_s", exclude={other.run_id})  # (lo, hi, n) or None

A change between two runs means something only when it is larger than what repeating one configuration gives.
Runs count as repeats of a configuration when the server they measured was the same: its command, the environment
its workers really had, the launcher's environment, the weights (by fingerprint) and the bench settings. A replay
of a launch is a repeat; a tune point at other settings, or a server that lost a variable, is not.
"""

from __future__ import annotations

import json
from typing import Any

from eyas.ledger.record import RunRecord
from eyas.ledger.server_command import stable_config

# Bookkeeping that differs between repeats of one configuration without changing it.
_VOLATILE_LAUNCH = ("replay_of", "tune", "workdir_base")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def signature(run: RunRecord) -> str:
    """A key equal for runs that measured the same configuration."""
    config = stable_config(run.config)
    if isinstance(config.get("launch"), dict):
        config["launch"] = {k: v for k, v in config["launch"].items() if k not in _VOLATILE_LAUNCH}
    workers = sorted({(k, v) for w in run.workers for k, v in w.env.items()})
    key = {"kind": "bench" if run.kind == "bench" else "launch", "config": config, "env": run.env,
           "workers": workers, "model": run.model_fingerprint or run.model,
           "draft": run.draft_fingerprint or run.draft}
    if run.kind != "bench":
        key["argv"] = run.argv
    return json.dumps(key, sort_keys=True, default=str)


def measured_spread(run: RunRecord, history: list[RunRecord], metric: str,
                    exclude: set[str] = frozenset()) -> tuple[float, float, int] | None:
    """(lowest, highest, how many) of `metric` over finished repeats of `run`'s configuration, `run` included.

    None when fewer than two repeats measured it: one run says nothing about its own spread.
    """
    key = signature(run)
    repeats = [run] + [r for r in history if r.run_id != run.run_id and r.run_id not in exclude
                       and signature(r) == key]
    values = [r.results[metric] for r in repeats if r.status == "ok" and _number(r.results.get(metric))]
    return (min(values), max(values), len(values)) if len(values) >= 2 else None
