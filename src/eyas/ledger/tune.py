"""`eyas tune`: sweep EAGLE-3 settings (and environment sets) for one launch config, against the plain baseline.

Usage: points, skipped = sweep_points([1, 2, 3], [1, 2], [2, 4, 8])
       rows = run_sweep(config, points, {...}, host, ledger)

Each point is a full launch (start, verify env, bench, stop) recorded as kind "tune", so any of them can be
replayed; the baseline is the same config without a draft, benched the same way, once per environment set. A
speedup means nothing without its baseline and acceptance length, so both are printed beside every number.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path

from eyas.config import SpecConfig
from eyas.errors import EyasError
from eyas.launch.launch import launch, log, plan_for
from eyas.launch.launch_config import ENV_KEY, LaunchConfig
from eyas.ledger.ledger import Ledger
from eyas.table import format_table

Point = tuple[int, int, int] | None  # (steps, topk, draft tokens); None is the no-speculation baseline


@dataclass
class Row:
    env_set: str
    point: Point
    run_id: str | None
    status: str
    output_tok_s: float | None = None
    accept_length: float | None = None
    error: str | None = None


def sweep_points(steps: list[int], topks: list[int], draft_tokens: list[int],
                 backend: str = "eyas") -> tuple[list[Point], list[str]]:
    """Valid, distinct (steps, topk, draft tokens); a chain (topk 1) always verifies steps + 1 tokens."""
    points: list[Point] = []
    skipped = []
    for s in steps:
        for k in topks:
            for t in draft_tokens:
                try:
                    sc = SpecConfig(steps=s, topk=k, draft_tokens=None if k == 1 else t)
                except EyasError as e:
                    skipped.append(f"steps {s}, topk {k}, draft tokens {t}: {e}")
                    continue
                if backend == "vllm" and k != 1:
                    skipped.append(f"steps {s}, topk {k}: vLLM's eagle3 config drafts a chain (topk 1 only)")
                    continue
                if (sc.steps, sc.topk, sc.draft_tokens) not in points:
                    points.append((sc.steps, sc.topk, sc.draft_tokens))
    return points, skipped


def load_env_sets(path: str | Path) -> dict[str, dict[str, str]]:
    """A TOML file of named environment sets, one table each: `[ll]` then `NCCL_PROTO = "LL"`."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise EyasError(f"no env-sets file at {path}") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, not text
        raise EyasError(f"cannot read --env-sets {path}: {getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise EyasError(f"{path} is not valid TOML: {e}") from None
    sets = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise EyasError(f"{path}: '{name}' must be a table of variables ([{name}] then KEY = \"VALUE\" lines)")
        for key, value in table.items():
            if not ENV_KEY.match(key) or isinstance(value, bool) or not isinstance(value, (str, int)):
                raise EyasError(f"{path}: [{name}] {key} must be a variable name with a string or integer value")
        sets[name] = {k: str(v) for k, v in table.items()}
    if not sets:
        raise EyasError(f"{path} defines no environment set")
    return sets


def point_config(config: LaunchConfig, point: Point, env: dict[str, str]) -> LaunchConfig:
    base = replace(config.without_speculation(), env={**config.env, **env})
    if point is None:
        return base
    steps, topk, tokens = point
    return replace(base, draft=config.draft, spec_steps=steps, spec_topk=topk, spec_draft_tokens=tokens)


def label(point: Point) -> str:
    return "baseline" if point is None else f"s{point[0]} k{point[1]} t{point[2]}"


def run_sweep(config: LaunchConfig, points: list[Point], env_sets: dict[str, dict[str, str]], host, ledger: Ledger,
              launched_by: list[str] | None = None) -> tuple[str, list[Row]]:
    sweep = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    rows = []
    todo = [(name, p) for name in env_sets for p in [None, *points]]
    for i, (name, point) in enumerate(todo, 1):
        log(f"eyas tune: [{i}/{len(todo)}] env set {name}, {label(point)}")
        plan = plan_for(point_config(config, point, env_sets[name]), host, kind="tune",
                        tune={"sweep": sweep, "env_set": name, "point": label(point)})
        try:
            out = launch(plan, host, ledger, launched_by=launched_by)
        except EyasError as e:  # one broken point must not cost the rest of the sweep; it is recorded as failed
            log(f"eyas tune: {label(point)}: {e}")
            rows.append(Row(name, point, getattr(e, "run_id", None), "failed", error=str(e)))
            continue
        r = out.results
        rows.append(Row(name, point, out.run_id, "ok" if out.ok else "failed", r.get("output_tok_s"),
                        r.get("accept_length")))
    return sweep, rows


def _baseline(rows: list[Row], env_set: str) -> Row | None:
    return next((r for r in rows if r.env_set == env_set and r.point is None and r.status == "ok"), None)


def best(rows: list[Row]) -> tuple[Row | None, Row | None]:
    """The fastest finished speculative point, and the baseline of its environment set."""
    ok = [r for r in rows if r.point is not None and r.status == "ok" and r.output_tok_s is not None]
    top = max(ok, key=lambda r: r.output_tok_s, default=None)
    return top, (_baseline(rows, top.env_set) if top else None)


def verdict(top: Row, base: Row | None) -> str:
    """The sweep's answer. A setting slower than the plain baseline is never called "best": the baseline is."""
    steps, topk, tokens = top.point
    setting = (f"steps {steps}, topk {topk}, draft tokens {tokens} (env set {top.env_set}): "
               f"{top.output_tok_s:.1f} tok/s, accept length {top.accept_length or 0:.2f}")
    if base is None or not base.output_tok_s:
        return f"best: {setting}; run {top.run_id} (no baseline finished: whether it beats plain decoding is unknown)"
    margin = f"{top.output_tok_s / base.output_tok_s - 1:+.1%}"
    if top.output_tok_s <= base.output_tok_s:
        return (f"best: the baseline without speculation, {base.output_tok_s:.1f} tok/s (run {base.run_id}); no "
                f"setting beat it, the fastest was {setting}, {margin} (run {top.run_id})")
    return f"best: {setting}, {margin} over the baseline {base.output_tok_s:.1f} tok/s; run {top.run_id}"


def render(rows: list[Row]) -> str:
    table = []
    for r in rows:
        base = _baseline(rows, r.env_set)
        vs = (f"{r.output_tok_s / base.output_tok_s - 1:+.1%}" if base and base.output_tok_s and r.output_tok_s
              is not None and r.point is not None else "-")
        table.append([r.env_set, *(["-"] * 3 if r.point is None else map(str, r.point)),
                      "-" if r.output_tok_s is None else f"{r.output_tok_s:.1f}",
                      "-" if r.accept_length is None else f"{r.accept_length:.2f}", vs, r.run_id or "-", r.status])
    return format_table(["env set", "steps", "topk", "draft tok", "out tok/s", "accept", "vs baseline", "run",
                         "status"], table)


def plot(rows: list[Row], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a GPU box
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.output_tok_s is not None]
    if not done:
        raise EyasError("no point finished a bench: nothing to plot")
    names = list(dict.fromkeys(r.env_set for r in done))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(done) + 2), 4.5))
    xs = range(len(done))
    colors = [f"C{names.index(r.env_set)}" for r in done]
    bars = ax.bar(xs, [r.output_tok_s for r in done], color=colors,
                  hatch=["//" if r.point is None else "" for r in done])
    for bar, r in zip(bars, done):
        if r.accept_length is not None and r.point is not None:
            ax.annotate(f"{r.accept_length:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    for name in names:
        base = _baseline(rows, name)
        if base and base.output_tok_s:
            ax.axhline(base.output_tok_s, color=f"C{names.index(name)}", linestyle="--", linewidth=1,
                       label=f"baseline ({name})")
    ax.set_xticks(list(xs), [f"{label(r.point)}\n{r.env_set}" if len(names) > 1 else label(r.point) for r in done],
                  rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("output tok/s (labels: accept length)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
