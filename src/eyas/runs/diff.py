"""What differs between two runs, and which differences most plausibly explain a change in results.

Usage: print(diff_runs(ledger.get("12"), ledger.get("31")).render())

explain() orders causes by how often they turned out to be the answer: first a variable the launcher asked for
that the workers never received (94 -> 62 tok/s was exactly that: NCCL tuning set in the parent, absent in the
spawned tensor-parallel workers), then any other worker-environment difference, then the launcher environment
(NCCL first), then speculative settings and arguments, then library versions, then hardware.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from eyas.runs.record import RunRecord
from eyas.runs.table import clip, format_table

_ENV_ORDER = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "EYAS_", "SGLANG_", "VLLM_", "OMP_", "MKL_")
_SPECULATIVE_WORDS = ("spec", "draft", "eagle", "topk", "step", "token", "model")
SECTIONS = ("arguments", "config", "environment", "workers", "versions", "hardware", "results")


@dataclass
class DiffRow:
    section: str
    key: str
    a: Any
    b: Any
    note: str = ""
    rank: tuple = ()  # lower sorts first in explain(); empty for results, which are effects, not causes


@dataclass
class RunDiff:
    a: RunRecord
    b: RunRecord
    sections: dict[str, list[DiffRow]] = field(default_factory=dict)
    identical: dict[str, int] = field(default_factory=dict)  # entries equal in both runs, per section

    def explain(self) -> list[DiffRow]:
        """Differences that could cause the change in results, most plausible first."""
        causes = [r for s in SECTIONS if s != "results" for r in self.sections.get(s, [])]
        return sorted(causes, key=lambda r: r.rank)

    def render(self) -> str:
        out = [f"A = {_label(self.a)}", f"B = {_label(self.b)}"]
        for name in SECTIONS:
            rows = self.sections.get(name, [])
            hidden = self.identical.get(name, 0)
            if not rows and not hidden:
                continue
            out.append(f"\n{name}" + (f" ({hidden} identical not shown)" if hidden and name != "results" else ""))
            if rows:
                out.append(format_table(["key", "A", "B", "note"],
                                        [[r.key, _show(r.a), _show(r.b), r.note] for r in rows]))
        causes = self.explain()
        out.append("\nmost plausible explanations, in order:" if causes else "\nno differences besides results")
        out += [f"{i}. [{r.section}] {r.key}: {_show(r.a)} -> {_show(r.b)}" + (f"  ({r.note})" if r.note else "")
                for i, r in enumerate(causes, 1)]
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


def _workers(diff: RunDiff) -> None:
    a, b = diff.a, diff.b
    keys = {k for run in (a, b) for w in run.workers for k in w.env}
    keys |= {k for run in (a, b) if run.workers for k in run.env}
    rows, same = [], 0
    for key in sorted(keys):
        (va, miss_a), (vb, miss_b) = _worker_value(a, key), _worker_value(b, key)
        notes = [f"{run.env[key]!s} requested, missing in {miss}/{len(run.workers)} workers of {name}"
                 for name, run, miss in (("A", a, miss_a), ("B", b, miss_b)) if miss]
        if not notes and va == vb:
            same += 1
            continue
        # A requested variable that never reached the workers is the prime suspect; more so when the other run's
        # workers did have it, because then it also differs between the runs.
        missing = bool(miss_a or miss_b)
        rank = (0 if missing else 1, 0 if va != vb else 1, _env_rank(key), key)
        rows.append(DiffRow("workers", key, va, vb, "; ".join(notes), rank))
    diff.sections["workers"] = rows
    diff.identical["workers"] = same


def _identity(run: RunRecord) -> dict[str, str]:
    """Which weights ran: the same path can hold different weights, hence the fingerprints."""
    keys = ("model", "draft", "model_fingerprint", "draft_fingerprint")
    return {k: getattr(run, k) for k in keys if getattr(run, k) is not None}


def diff_runs(a: RunRecord, b: RunRecord) -> RunDiff:
    diff = RunDiff(a, b)
    _compare("arguments", {**_identity(a), **argv_options(a.argv)}, {**_identity(b), **argv_options(b.argv)},
             lambda k: (3, _spec_rank(k), k), diff)
    _compare("config", flatten(a.config), flatten(b.config), lambda k: (3, _spec_rank(k), k), diff)
    _compare("environment", a.env, b.env, lambda k: (2, _env_rank(k), k), diff)
    _workers(diff)
    _compare("versions", flatten(a.versions), flatten(b.versions), lambda k: (4, 0, k), diff, whole=True)
    _compare("hardware", flatten(a.hardware), flatten(b.hardware), lambda k: (5, 0, k), diff, whole=True)
    results = []
    for k in sorted(set(a.results) | set(b.results)):
        va, vb = a.results.get(k), b.results.get(k)
        note = ""
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool) and va:
            note = f"{(vb - va) / abs(va):+.1%}"
        results.append(DiffRow("results", k, va, vb, note))
    diff.sections["results"] = results
    return diff
