"""`eyas runs`: query the run ledger.

Usage:
    eyas runs list --where kind=bench --where env.NCCL_PROTO=LL --sort output_tok_s --limit 10
    eyas runs show 42
    eyas runs best --metric output_tok_s --where config.spec_steps=2
    eyas runs diff 12 31
    eyas runs replay 12 --threshold 0.1
    eyas runs export --format csv --out runs.csv
    eyas runs plot --metric output_tok_s --by spec_steps --out tok_s.png
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from datetime import datetime
from pathlib import Path

from eyas.errors import EyasError
from eyas.paths import image_file, output_file, write_output
from eyas.ledger.diff import diff_runs, flatten
from eyas.ledger.ledger import Ledger, field_sql
from eyas.ledger.record import COLUMNS, RunRecord, metric_field
from eyas.table import clip, format_table, one_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", help="ledger file (default: $EYAS_HOME/runs.db)")
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    where = dict(action="append", default=[], metavar="KEY=VALUE",
                 help="only runs where KEY (kind, status, config.X, env.X, results.X, workers.X, ...) equals VALUE")
    p = sub.add_parser("list", help="list runs, newest first or by a metric")
    p.add_argument("--where", **where)
    p.add_argument("--sort", metavar="METRIC", help="sort by a result (output_tok_s) or field, highest first")
    p.add_argument("--ascending", action="store_true", help="with --sort: lowest first")
    p.add_argument("--limit", type=int, default=20, help="most runs to list (default 20)")
    p = sub.add_parser("show", help="everything about one run, with the command that reproduces it")
    p.add_argument("id", help="the run's id (as `eyas runs list` prints it)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p = sub.add_parser("best", help="the finished run with the best value of a metric")
    p.add_argument("--metric", required=True, help="a result to rank by, e.g. output_tok_s")
    p.add_argument("--where", **where)
    p.add_argument("--lower-is-better", action="store_true", help="the smallest value is the best (latencies)")
    p = sub.add_parser("diff", help="what differs between two runs, most plausible cause first")
    p.add_argument("a", help="the first run's id")
    p.add_argument("b", help="the second run's id")
    p = sub.add_parser("replay", help="start a recorded launch again the same way, bench it, compare (exit 1: FAIL)")
    p.add_argument("id", help="the id of the recorded launch to replay")
    p.add_argument("--threshold", type=float, default=0.1,
                   help="largest tolerated relative worsening of a gated result (default 0.1 = 10%%)")
    p.add_argument("--keep-running", action="store_true", help="leave the replayed server up")
    p = sub.add_parser("export", help="every run as JSON lines or CSV")
    p.add_argument("--format", choices=["jsonl", "csv"], default="jsonl", help="output format (default jsonl)")
    p.add_argument("--out", help="file to write (default: stdout)")
    p.add_argument("--where", **where)
    p = sub.add_parser("plot", help="a metric against one parameter, as a PNG")
    p.add_argument("--metric", required=True, help="the result on the y axis, e.g. output_tok_s")
    p.add_argument("--by", required=True, metavar="PARAM", help="config.X, env.X, ... (a bare name means config.X)")
    p.add_argument("--out", required=True, help="image file to write (.png, or another type matplotlib writes)")
    p.add_argument("--where", **where)


def parse_where(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise EyasError(f"bad --where '{item}': expected KEY=VALUE, e.g. env.NCCL_PROTO=LL")
        field_sql(key.strip())  # unknown fields fail here, with the list of valid ones
        out[key.strip()] = value
    return out


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _headline(run: RunRecord, n: int = 3) -> str:
    nums = [(k, v) for k, v in run.results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return " ".join(f"{k}={v:g}" for k, v in nums[:n])


def _tok_s(run: RunRecord) -> str:
    value = run.results.get("output_tok_s")
    return f"{value:.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _list(ledger: Ledger, args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise EyasError(f"--limit must be >= 1, got {args.limit}")
    where = parse_where(args.where)
    runs = ledger.list(where, args.sort, args.limit, descending=not args.ascending)
    if not runs:
        raise EyasError("no runs match" + (f" {' '.join(args.where)}" if where else ""))
    sort_key = metric_field(args.sort) if args.sort else None
    if sort_key and sort_key not in COLUMNS and runs[0].get(sort_key) is None:  # runs without it sort last
        _unknown_sort(args.sort, sort_key, ledger.list(where), args.where)
    headers = ["id", "kind", "status", "started", "model", "draft", "tok/s"] + ([sort_key] if sort_key else []) \
        + ["results"]
    rows = [[r.run_id, r.kind, r.status, _when(r.started_at), clip(Path(r.model).name if r.model else "-", 28),
             clip(Path(r.draft).name if r.draft else "-", 28), _tok_s(r)]
            + ([str(r.get(sort_key))] if sort_key else []) + [_headline(r)] for r in runs]
    print(format_table(headers, rows))
    return 0


def _unknown_sort(sort: str, key: str, runs: list[RunRecord], where: list[str]) -> None:
    """No matching run has the field: the column would be all None, the order meaningless."""
    head = key.partition(".")[0]
    if head == "workers":
        names = {f"workers.{k}" for r in runs for w in r.workers for k in w.env}
    else:
        names = {k if head == "results" else f"{head}.{k}" for r in runs for k in flatten(getattr(r, head))}
    matching = f" where {' '.join(where)}" if where else ""
    raise EyasError(f"unknown --sort key '{sort}': no run{matching} has {key}; valid keys: {', '.join(COLUMNS)}"
                    + (f", {', '.join(sorted(names))}" if names else f" (no run{matching} records any {head}.X)"))


def _section(title: str, values: dict) -> list[str]:
    flat = flatten(values)
    return [f"{title}:"] + [f"  {k} = {one_line(v)}" for k, v in flat.items()] if flat else [f"{title}: (none)"]


def show_text(run: RunRecord) -> str:
    took = f", took {run.finished_at - run.started_at:.1f} s" if run.finished_at else ""
    lines = [f"run {run.run_id}: {run.kind}, {run.status}, started {_when(run.started_at)}{took}, host {run.host}",
             f"command: {run.command()}", f"cwd: {run.cwd}"]
    for name in ("model", "draft"):
        if getattr(run, name):
            fp = getattr(run, f"{name}_fingerprint")
            lines.append(f"{name}: {getattr(run, name)}" + (f" (sha256 {fp[:16]})" if fp else ""))
    lines += _section("config", run.config) + _section("environment", run.env)
    lines.append(f"workers: {len(run.workers)}" if run.workers else "workers: (none recorded)")
    for w in run.workers:
        lines.append(f"  {w.worker}: {w.info.get('cmdline', '')}".rstrip())
        missing = sorted(k for k, v in run.env.items() if w.env.get(k) != v)
        lines += [f"    {k} = {one_line(v)}" for k, v in sorted(w.env.items())]
        if missing:
            lines.append(f"    MISSING from launcher environment: {', '.join(missing)}")
    topo = run.hardware.get("gpu_topology")
    hw = {k: v for k, v in run.hardware.items() if k not in ("gpu_topology", "gpus")}
    lines += _section("versions", run.versions) + _section("hardware", hw)
    if topo:
        lines += ["gpu topology:"] + ["  " + ln for ln in topo.splitlines()]
    return "\n".join(lines + _section("results", run.results))


def workload(run: RunRecord) -> tuple:
    """(dataset, prompts, max tokens) a run was benched with; runs are only ranked against the same workload."""
    bench = run.config.get("bench") if run.kind in ("launch", "tune") else run.config if run.kind == "bench" else None
    if not isinstance(bench, dict) or "dataset" not in bench:
        return ()
    return bench.get("dataset"), bench.get("num_prompts"), bench.get("max_tokens")


def describe_workload(load: tuple) -> str:
    if not load:
        return "workload not recorded"
    dataset, prompts, max_tokens = load
    return f"dataset {dataset}, {'every' if prompts is None else prompts} prompts, max tokens {max_tokens}"


def _best(ledger: Ledger, args: argparse.Namespace) -> int:
    key = metric_field(args.metric)
    where = parse_where(args.where)
    where.setdefault("status", "ok")
    runs = [r for r in ledger.list(where) if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    if not runs:
        raise EyasError(f"no finished run has a numeric {key}"
                        + (f" where {' '.join(args.where)}" if args.where else ""))
    groups: dict[tuple, list[RunRecord]] = {}
    for r in runs:
        groups.setdefault(workload(r), []).append(r)
    pick = min if args.lower_is_better else max
    for i, (load, members) in enumerate(sorted(groups.items(), key=lambda g: -len(g[1]))):
        top = pick(members, key=lambda r: (r.get(key), -r.started_at if args.lower_is_better else r.started_at))
        print(("\n" if i else "") + f"{top.run_id}  {key} = {top.get(key)}")
        print(f"command: {top.command()}")
        print(f"compared like with like: the best of {len(members)} run(s) on {describe_workload(load)}")
    if len(groups) > 1:
        print(f"\n{len(groups)} workloads: runs benched on a different dataset, prompt count or max tokens are not "
              f"ranked against each other")
    return 0


def export_rows(runs: list[RunRecord]) -> tuple[list[str], list[dict]]:
    fixed = ["run_id", "kind", "status", "started_at", "finished_at", "host", "model", "draft", "model_fingerprint",
             "draft_fingerprint", "cwd", "command", "workers"]
    rows, extra = [], set()
    for r in runs:
        row = {k: getattr(r, k) for k in fixed if k not in ("command", "workers")}
        row.update(command=r.command(), workers=len(r.workers))
        for section in ("config", "env", "results", "versions", "hardware"):
            for k, v in flatten(getattr(r, section)).items():
                row[f"{section}.{k}"] = json.dumps(v) if isinstance(v, (list, dict)) else v
        extra |= set(row) - set(fixed)
        rows.append(row)
    return fixed + sorted(extra), rows


def _export(ledger: Ledger, args: argparse.Namespace) -> int:
    if args.out:
        output_file(args.out, "--out")
    runs = ledger.list(parse_where(args.where), descending=False)
    if not runs:
        raise EyasError("no runs to export")
    buf = io.StringIO()
    if args.format == "jsonl":
        buf.writelines(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in runs)
    else:
        columns, rows = export_rows(runs)
        writer = csv.DictWriter(buf, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    if args.out:
        write_output(args.out, buf.getvalue(), "--out")
        print(f"wrote {len(runs)} runs to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(buf.getvalue())
    return 0


def _plot(ledger: Ledger, args: argparse.Namespace) -> int:
    out = image_file(args.out, "--out")
    by = args.by if "." in args.by or args.by in COLUMNS else f"config.{args.by}"
    metric = metric_field(args.metric)
    points = [(r.get(by), r.get(metric)) for r in ledger.list(parse_where(args.where))]
    points = [(x, y) for x, y in points if x is not None and isinstance(y, (int, float)) and not isinstance(y, bool)]
    if not points:
        raise EyasError(f"no runs have both {by} and a numeric {metric}")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a GPU box
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise EyasError(f"--out {args.out}: unsupported image type '{out.suffix}'; use one of "
                        f"{', '.join('.' + f for f in sorted(formats))}")

    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _ in points)
    categories = sorted({str(x) for x, _ in points})
    xs = [x if numeric else categories.index(str(x)) for x, _ in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(xs, [y for _, y in points], alpha=0.7)
    if not numeric:
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_xlabel(by)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by {by} ({len(points)} runs)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise EyasError(f"cannot write --out {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    print(f"wrote {out} ({len(points)} runs)", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        code = _run(args)
        sys.stdout.flush()  # inside the try: a reader that left early (`| head`) is seen here, not at exit
        return code
    except BrokenPipeError:
        # Whatever is still buffered has nowhere to go; point stdout at /dev/null so exit does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace) -> int:
    with Ledger.existing(args.db) as ledger:
        if args.action == "list":
            return _list(ledger, args)
        if args.action == "show":
            run = ledger.get(args.id)
            print(json.dumps(run.to_dict(), indent=2, sort_keys=True) if args.json else show_text(run))
            return 0
        if args.action == "best":
            return _best(ledger, args)
        if args.action == "diff":
            print(diff_runs(ledger.get(args.a), ledger.get(args.b), history=ledger.list()).render())
            return 0
        if args.action == "replay":
            from eyas.ledger.replay import replay_command  # starts servers; `runs list` must not import it

            return replay_command(ledger, args)
        if args.action == "export":
            return _export(ledger, args)
        return _plot(ledger, args)
