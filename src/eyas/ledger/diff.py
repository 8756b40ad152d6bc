"""What differs between two runs, and which differences most plausibly explain a change in results.

Usage: print(diff_runs(ledger.get("12"), ledger.get("31"), history=ledger.list()).render())

render() puts the ranked causes first, then the results (a change within the configuration's measured run-to-run
spread is labelled noise), then each section's table. explain() orders causes by how often they turned out to be
the answer: a server that never started (then nothing else about it matters: its missing variables are not
causes); a variable that reached one run's workers and not the other's, or that the launcher asked for and the
workers never received (94 -> 62 tok/s was exactly that: NCCL tuning absent in the spawned tensor-parallel
workers); different weights behind a path; any other worker-environment difference; the launcher and host login
environments (NCCL first); speculative settings and arguments; library versions; hardware.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from eyas.ledger.record import RunRecord
from eyas.ledger.server_command import login_env, never_started, server_command, stable_config
from eyas.ledger.spread import measured_spread
from eyas.table import clip, format_table

_ENV_ORDER = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "EYAS_", "SGLANG_", "VLLM_", "OMP_", "MKL_")
# Set anew by the engine at every start (vLLM's process-group and shared-memory names): a difference is no cause.
_PER_START = ("VLLM_DIST_IDENT", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")
_SPECULATIVE_WORDS = ("spec", "draft", "eagle", "topk", "step", "token", "model")
SECTIONS = ("run", "weights", "arguments", "config", "environment", "login environment", "workers", "versions",
            "hardware", "results")


@dataclass
class DiffRow:
    section: str
    key: str
    a: Any
    b: Any
    note: str = ""
    rank: tuple = ()  # lower sorts first in explain(); empty: shown, but not a cause (results, same weights)


@dataclass
class RunDiff:
    a: RunRecord
    b: RunRecord
    sections: dict[str, list[DiffRow]] = field(default_factory=dict)
    identical: dict[str, int] = field(default_factory=dict)  # entries equal in both runs, per section

    def explain(self) -> list[DiffRow]:
        """Differences that could cause the change in results, most plausible first."""
        causes = [r for s in SECTIONS if s != "results" for r in self.sections.get(s, []) if r.rank]
        return sorted(causes, key=lambda r: r.rank)

    def render(self) -> str:
        out = [f"A = {_label(self.a)}", f"B = {_label(self.b)}"]
        causes = self.explain()
        out.append("most plausible explanations, in order:" if causes else "no differences besides results")
        out += [f"{i}. [{r.section}] {r.key}: {_show(r.a)} -> {_show(r.b)}" + (f"  ({r.note})" if r.note else "")
                for i, r in enumerate(causes, 1)]
        for name in ("results", *[s for s in SECTIONS if s != "results"]):
            rows = self.sections.get(name, [])
            hidden = self.identical.get(name, 0)
            if not rows and not hidden:
                continue
            out.append(f"\n{name}" + (f" ({hidden} identical not shown)" if hidden and name != "results" else ""))
            if rows:
                out.append(format_table(["key", "A", "B", "note"],
                                        [[r.key, _show(r.a), _show(r.b), r.note] for r in rows]))
        return "\n".join(out)


def _label(run: RunRecord) -> str:
    when = datetime.fromtimestamp(run.started_at).strftime("%Y-%m-%d %H:%M")
    return f"{run.run_id} ({run.kind}, {run.status}, {when})"


def _show(value: Any) -> str:
    return "(unset)" if value is None else clip(value, 40)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def argv_options(argv: list[str]) -> dict[str, str]:
    """`--tp-size 8 --trust-remote-code x.py` -> {"--tp-size": "8", "--trust-remote-code": "true", "(args)": ...}."""
    out, positional, i = {}, [], 1
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("-") and len(tok) > 1 and not _is_number(tok):
            key, eq, value = tok.partition("=")
            if not eq:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                value = "true" if nxt is None or (nxt.startswith("-") and not _is_number(nxt)) else nxt
                i += value is nxt
            out[key] = value
        else:
            positional.append(tok)
        i += 1
    if positional:
        out["(args)"] = " ".join(positional)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _env_rank(key: str) -> int:
    return next((i for i, p in enumerate(_ENV_ORDER) if key.startswith(p)), len(_ENV_ORDER))


def _spec_rank(key: str) -> int:
    return 0 if any(w in key.lower() for w in _SPECULATIVE_WORDS) else 1


def _recorded(d: dict) -> str:
    return f"{len(d)} entries" if d else "not recorded"


def _compare(section: str, a: dict, b: dict, rank, diff: RunDiff, whole: bool = False) -> None:
    if whole and bool(a) != bool(b):  # one run predates capturing this section: one row, not one per entry
        diff.sections[section] = [DiffRow(section, "(all)", _recorded(a), _recorded(b), rank=rank(""))]
        return
    rows = [DiffRow(section, k, a.get(k), b.get(k), rank=rank(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
    diff.sections.setdefault(section, []).extend(rows)
    diff.identical[section] = diff.identical.get(section, 0) + len(set(a) & set(b)) - sum(
        1 for r in rows if r.a is not None and r.b is not None)


def _worker_value(run: RunRecord, key: str) -> tuple[str | None, int]:
    """("LL x8" / "unset x7, LL x1", how many workers lack the value the launcher asked for)."""
    if not run.workers:
        return None, 0
    values = [w.env.get(key) for w in run.workers]
    text = ", ".join(f"{'unset' if v is None else v} x{n}" for v, n in Counter(values).most_common())
    requested = run.env.get(key)
    return text, (sum(v != requested for v in values) if requested is not None else 0)


def _distinct(run: RunRecord, key: str) -> set:
    return {w.env.get(key) for w in run.workers}


def _absent_everywhere(run: RunRecord, key: str) -> bool:
    return bool(run.workers) and all(key not in w.env for w in run.workers)


def _workers(diff: RunDiff) -> None:
    a, b = diff.a, diff.b
    if never_started(a) or never_started(b):  # no workers to compare: the run section names the cause
        diff.sections["workers"], diff.identical["workers"] = [], 0
        return
    runs = [("A", a), ("B", b)]
    keys = {k for _, run in runs for w in run.workers for k in w.env}
    keys |= {k for _, run in runs if run.workers for k in run.env}
    rows, same = [], 0
    for key in sorted(keys):
        (va, miss_a), (vb, miss_b) = _worker_value(a, key), _worker_value(b, key)
        notes = [f"{run.env[key]!s} requested, missing in {miss}/{len(run.workers)} workers of {name}"
                 for name, run, miss in (("A", a, miss_a), ("B", b, miss_b)) if miss]
        # A variable one run's workers had and the other's lacked entirely: `NCCL_ALGO=Ring; vllm serve` looks
        # exactly like this next to a launch that exported it.
        lost = [(name, other) for (name, run), (other, orun) in ((("A", a), ("B", b)), (("B", b), ("A", a)))
                if _absent_everywhere(run, key) and any(key in w.env for w in orun.workers)]
        notes += [f"in the workers of {other}, missing in every worker of {name}" for name, other in lost]
        notes += [f"in {name}'s login environment, not in its workers" for name, run in runs
                  if key in login_env(run) and any(key not in w.env for w in run.workers)]
        if not notes and va == vb:
            same += 1
            continue
        missing = bool(miss_a or miss_b or lost)
        rank = (1 if missing else 3, 0 if va != vb else 1, _env_rank(key), key)
        if not missing and key in _PER_START:
            rank, notes = (), notes + ["set anew by the engine at every start"]
        elif not missing and not notes and _distinct(a, key) == _distinct(b, key):
            # "16777216 x6 -> 16777216 x2": the same value, read from fewer processes; not a cause.
            rank, notes = (), ["the same value; only the number of processes read differs"]
        rows.append(DiffRow("workers", key, va, vb, "; ".join(notes), rank))
    diff.sections["workers"] = rows
    diff.identical["workers"] = same


def _weights(diff: RunDiff) -> None:
    """Which weights ran: the same path can hold retrained weights, and a copy under a new path is the same."""
    rows, same = [], 0
    for name in ("model", "draft"):
        (pa, fa), (pb, fb) = [(getattr(r, name), getattr(r, f"{name}_fingerprint")) for r in (diff.a, diff.b)]
        if pa is None and pb is None:
            continue
        if fa and fb and fa == fb:
            if pa == pb:
                same += 1
            else:
                rows.append(DiffRow("weights", name, pa, pb, "same weights (equal fingerprints) under a new path"))
        elif fa and fb:
            why = "same path, different contents (retrained or replaced)" if pa == pb else "different weights"
            rows.append(DiffRow("weights", f"{name} contents", fa[:12], fb[:12], f"{why}: {pa} / {pb}",
                                (2, _spec_rank(name), name)))
        elif pa != pb:
            rows.append(DiffRow("weights", name, pa, pb, "not fingerprinted: same weights unknown",
                                (5, _spec_rank(name), name)))
        else:
            same += 1
    diff.sections["weights"], diff.identical["weights"] = rows, same


def _arguments(diff: RunDiff) -> None:
    """The server's own command line, option by option; a `bash -c` line is read for the command it runs."""
    (argv_a, how_a), (argv_b, how_b) = server_command(diff.a), server_command(diff.b)
    if argv_a is None or argv_b is None:
        if (argv_a is None) != (argv_b is None):
            diff.sections["arguments"] = [DiffRow("arguments", "(server command)", how_a or "not recorded",
                                                  how_b or "not recorded", rank=(6, 1, ""))]
        return
    _compare("arguments", argv_options(argv_a), argv_options(argv_b), lambda k: (6, _spec_rank(k), k), diff)
    if how_a != how_b:
        diff.sections["arguments"].append(DiffRow("arguments", "(started by)", how_a, how_b,
                                                  "compared as the command each one runs", (6, 2, "")))


def _run_state(diff: RunDiff) -> None:
    rows = []
    for name, run in (("A", diff.a), ("B", diff.b)):
        if never_started(run):
            error = run.results.get("error") or run.status
            rows.append(DiffRow("run", "server", "never started" if name == "A" else "started",
                                "never started" if name == "B" else "started", f"{name}: {clip(error, 120)}",
                                (0, name)))
    diff.sections["run"] = rows


def _results(diff: RunDiff, history: list[RunRecord]) -> None:
    a, b = diff.a, diff.b
    rows = []
    for k in sorted(set(a.results) | set(b.results)):
        va, vb = a.results.get(k), b.results.get(k)
        note = ""
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool) and va:
            note = f"{(vb - va) / abs(va):+.1%}"
            spreads = [s for s in (measured_spread(a, history, k, {b.run_id}),
                                   measured_spread(b, history, k, {a.run_id})) if s]
            if spreads and va != vb:
                lo, hi, n = max(spreads, key=lambda s: s[1] - s[0])
                within = abs(vb - va) <= hi - lo
                note += (f" noise: within the {(hi - lo) / abs(va):.1%} run-to-run spread of {n} runs" if within
                         else f" (beyond the {(hi - lo) / abs(va):.1%} run-to-run spread of {n} runs)")
        rows.append(DiffRow("results", k, va, vb, note))
    diff.sections["results"] = rows


def diff_runs(a: RunRecord, b: RunRecord, history: list[RunRecord] | None = None) -> RunDiff:
    """`history`: other runs of the ledger, to measure each configuration's run-to-run spread."""
    diff = RunDiff(a, b)
    _run_state(diff)
    _weights(diff)
    _arguments(diff)
    _compare("config", flatten(stable_config(a.config)), flatten(stable_config(b.config)),
             lambda k: (6, _spec_rank(k), k), diff)
    _compare("environment", a.env, b.env, lambda k: (4, _env_rank(k), k), diff)
    if login_env(a) or login_env(b):
        _compare("login environment", login_env(a), login_env(b), lambda k: (4, 10 + _env_rank(k), k), diff)
    _workers(diff)
    _compare("versions", flatten(a.versions), flatten(b.versions), lambda k: (7, 0, k), diff, whole=True)
    _compare("hardware", flatten(a.hardware), flatten(b.hardware), lambda k: (8, 0, k), diff, whole=True)
    _results(diff, history or [])
    return diff
