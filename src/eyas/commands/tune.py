"""`eyas tune`: sweep speculative settings (and environment sets) for one launch config, against the baseline.

Usage: eyas tune --config kimi.toml --steps 1,2,3,5 --topk 1,2,4 --draft-tokens 2,4,8 --dataset mt-bench \\
           --num-prompts 20 [--env-sets nccl.toml] [--plot tune.png]

Impossible combinations are skipped (eyas.config.SpecConfig says why); with topk 1 the draft tokens are always
steps + 1, so those points collapse into one. Each point, and the no-speculation baseline of each environment
set, is a full launch recorded as kind "tune" (`eyas runs list --where kind=tune`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from eyas.commands.launch import add_host_arguments, make_host
from eyas.errors import EyasError
from eyas.paths import image_file
from eyas.launch.launch_config import BenchConfig, load_config


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--config", metavar="CONFIG.toml", help="the launch config (its draft is tuned)")
    # The old spelling, kept out of --help: run ledgers hold past `eyas tune --spec` lines, which must still run.
    g.add_argument("--spec", dest="config", metavar="CONFIG.toml", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=_ints, default=[1, 2, 3, 5], help="draft depths (default 1,2,3,5)")
    p.add_argument("--topk", type=_ints, default=[1], help="branching per step (default 1)")
    p.add_argument("--draft-tokens", type=_ints, default=[2, 4, 8],
                   help="tokens sent to verify, root included (ignored for topk 1: steps + 1)")
    p.add_argument("--env-sets", metavar="FILE", help="TOML of named environment sets: [ll] NCCL_PROTO = \"LL\"")
    p.add_argument("--dataset", help="bench dataset (default: the config's [bench])")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--plot", metavar="PNG", help="where to write the plot (default tune-SWEEP.png)")
    p.add_argument("--python", help="the server's interpreter (overrides the config's `python`)")
    p.add_argument("--db", help="ledger file (default: $EYAS_HOME/runs.db)")
    add_host_arguments(p)


def run(args: argparse.Namespace) -> int:
    from eyas.ledger.ledger import Ledger
    from eyas.ledger.tune import best, load_env_sets, plot, render, run_sweep, sweep_points, verdict

    config = load_config(args.config)
    if args.python:
        config = replace(config, python=args.python)
    if config.draft is None:
        raise EyasError(f"{args.config} has no draft: tuning needs `draft` in the launch config")
    given = {k: v for k, v in (("dataset", args.dataset), ("num_prompts", args.num_prompts),
                               ("max_tokens", args.max_tokens), ("concurrency", args.concurrency)) if v is not None}
    if "dataset" in given and Path(given["dataset"]).is_file():
        given["dataset"] = str(Path(given["dataset"]).resolve())
    if config.bench is None and "dataset" not in given:
        raise EyasError("tuning needs a bench: pass --dataset or add [bench] to the launch config")
    config = replace(config, bench=replace(config.bench or BenchConfig(), **given))
    env_sets = load_env_sets(args.env_sets) if args.env_sets else {"config": {}}
    # Checked before the sweep, which can take hours, rather than when the plot is written.
    plot_file = image_file(args.plot, "--plot") if args.plot else None
    points, skipped = sweep_points(args.steps, args.topk, args.draft_tokens, config.backend)
    for reason in skipped:
        print(f"eyas tune: skipped {reason}", file=sys.stderr)
    if not points:
        raise EyasError("no valid combination of --steps, --topk and --draft-tokens")
    host = make_host(args)
    with Ledger(args.db) as ledger:
        sweep, rows = run_sweep(config, points, env_sets, host, ledger, args.argv)
    print(render(rows))
    top, base = best(rows)
    if top is None:
        print("no speculative point finished its bench")
        return 1
    print(verdict(top, base))
    out = plot_file or f"tune-{sweep}.png"
    try:
        plot(rows, out, f"{Path(args.config).name}: output tok/s per setting (sweep {sweep})")
    except OSError as e:  # every run is in the ledger already
        raise EyasError(f"cannot write the plot {out}: {e.strerror or e} (the runs are recorded: eyas runs list "
                        f"--where kind=tune)") from None
    print(f"plot: {out}")
    return 0 if all(r.status == "ok" for r in rows) else 1
