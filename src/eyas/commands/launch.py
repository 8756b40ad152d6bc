"""`eyas launch`: start a server from a launch config, verify every process's environment, bench, record.

Usage:
    eyas launch kimi-eagle3.toml                         # start, verify env, bench (if [bench]), stop, record
    eyas launch kimi-eagle3.toml --dry-run               # print the exact command line, start nothing
    eyas launch kimi-eagle3.toml --host root@10.1.230.174 --ssh-option Port=22 --keep-running
    eyas launch --from-shell 'NCCL_PROTO=LL python -m sglang.launch_server ...' --write kimi.toml
    eyas launch --from-shell 'NCCL_PROTO=LL; eyas serve --model demo' --run --bench-dataset mt-bench
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from eyas.commands.draft import check_before_launch
from eyas.errors import EyasError
from eyas.paths import output_file, write_output
from eyas.launch import hostprobe
from eyas.launch.launch_config import BenchConfig, LaunchConfig, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", metavar="CONFIG.toml", help="the launch config")
    p.add_argument("--dry-run", action="store_true", help="print the command (and remote script); start nothing")
    p.add_argument("--keep-running", action="store_true", help="leave the server up (stop it: eyas remote stop ID)")
    add_host_arguments(p)
    p.add_argument("--python", help="the server's interpreter (overrides the config's `python`)")
    p.add_argument("--db", help="ledger file (default: $EYAS_HOME/runs.db)")
    add_bench_arguments(p)
    g = p.add_argument_group("importing a pasted command line")
    g.add_argument("--from-shell", metavar="LINE", help="read a shell line: show what it really sets and runs")
    g.add_argument("--write", metavar="CONFIG.toml", help="with --from-shell: write the equivalent launch config here")
    g.add_argument("--as-intended", action="store_true",
                   help="with --from-shell: put every assignment the line meant to set into the config")
    g.add_argument("--run", action="store_true",
                   help="with --from-shell: run the line itself with bash -c, verify and record it like a config")


def add_host_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", metavar="[USER@]HOST", help="start the server there over ssh (default: this machine)")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                   help="passed to ssh as -o OPT, e.g. Port=2222 or IdentityFile=~/.ssh/id_ed25519 (repeatable)")
    p.add_argument("--remote-dir", help="where launch scripts and logs go on the host (default ~/.cache/eyas/launches)")
    p.add_argument("--clean-env", action="store_true",
                   help="with --host: start the server from the base variables only, not from the host's login "
                        "environment (what a command typed after `ssh HOST` gets, the default)")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench (overrides the config's [bench])")
    g.add_argument("--bench-dataset", help="mt-bench, humaneval or PATH.jsonl")
    g.add_argument("--bench-prompts", type=int, metavar="N")
    g.add_argument("--bench-concurrency", type=int, metavar="N")
    g.add_argument("--bench-max-tokens", type=int, metavar="N")
    g.add_argument("--no-bench", action="store_true", help="skip the config's bench")


def apply_overrides(config: LaunchConfig, args: argparse.Namespace) -> LaunchConfig:
    if args.python:
        config = replace(config, python=args.python)
    if getattr(args, "no_bench", False):
        return replace(config, bench=None)
    given = {k: v for k, v in (("dataset", args.bench_dataset), ("num_prompts", args.bench_prompts),
                               ("concurrency", args.bench_concurrency), ("max_tokens", args.bench_max_tokens))
             if v is not None}
    if given:
        if "dataset" in given and Path(given["dataset"]).is_file():  # a replay may run from another directory
            given["dataset"] = str(Path(given["dataset"]).resolve())
        bench = config.bench or BenchConfig()
        config = replace(config, bench=replace(bench, **given))
    return config


def make_host(args: argparse.Namespace):
    from eyas.launch.launch_host import LocalHost
    from eyas.launch.remote import SshHost

    if args.host:
        return SshHost(args.host, args.ssh_option, args.remote_dir, clean_env=args.clean_env)
    if args.ssh_option or args.clean_env:
        raise EyasError("--ssh-option and --clean-env go with --host (a local launch always starts from the base "
                        "variables)")
    return LocalHost(str(Path(args.remote_dir).expanduser().resolve()) if args.remote_dir else None)


def _dry_run(plan, host) -> int:
    from eyas.launch.remote import render_script
    from eyas.shell.shell import command_line

    base = ", ".join(hostprobe.BASE_ENV)
    if host.via == "ssh":
        print(f"# ssh {host.target}: the script below is copied to the host and started with setsid nohup")
        print(f"# (the base variables {base} are filled in from the login when it runs)" if host.clean_env else
              "# (it starts from the host's login environment, as a command typed after `ssh HOST` does)")
        print(render_script(plan.argv, plan.env, "DRY-RUN", host.clean_env), end="")
    else:
        print(f"# plus the base variables from this login ({base}); nothing else is inherited")
        print(command_line(plan.argv, plan.env))
    return 0


def _summary(outcome, keep_running: bool) -> str:
    r = outcome.results
    parts = [f"run {outcome.run_id}: {'ok' if outcome.ok else 'FAILED'}",
             f"environment {'verified in' if r.get('env_verified') else 'NOT verified in'} "
             f"{r.get('processes', 0)} processes"]
    if "output_tok_s" in r:
        accept = r.get("accept_length")
        parts.append(f"{r['output_tok_s']:.1f} output tok/s" + (f", accept length {accept:.2f}" if accept else ""))
    line = ", ".join(parts)
    if keep_running and outcome.ok:
        line += f"\nstill running: eyas remote status|logs|stop {outcome.run_id}"
    return line


def run(args: argparse.Namespace) -> int:
    from eyas.launch.launch import launch, plan_for
    from eyas.ledger.ledger import Ledger

    if bool(args.config) == bool(args.from_shell):
        raise EyasError("give a CONFIG.toml or --from-shell LINE (one of them)")
    if args.from_shell:
        config = _from_shell(args)
        if config is None:
            return 0
    else:
        if args.write or args.as_intended or args.run:
            raise EyasError("--write, --as-intended and --run go with --from-shell")
        config = apply_overrides(load_config(args.config), args)
    check_before_launch(config.draft, config.model, config.backend)  # a draft the engine would run wrongly stops here
    host = make_host(args)
    plan = plan_for(config, host)
    if args.dry_run:
        return _dry_run(plan, host)
    with Ledger(args.db) as ledger:
        outcome = launch(plan, host, ledger, keep_running=args.keep_running, launched_by=args.argv)
    print(_summary(outcome, args.keep_running))
    return 0 if outcome.ok else 1


def _from_shell(args: argparse.Namespace) -> LaunchConfig | None:
    from eyas.launch.from_shell import import_line

    if args.write:
        output_file(args.write, "--write")
    imported = import_line(args.from_shell)
    print(imported.explain())
    config = imported.config(args.as_intended)
    if args.write:
        write_output(args.write, config.to_toml(), "--write")
        print(f"wrote {args.write}", file=sys.stderr)
    else:
        print("\nequivalent launch config:\n" + config.to_toml(), end="")
    if not args.run:
        return None
    if imported.host or args.host:
        raise EyasError("--run runs the line on this machine; for a remote line use --write, then "
                        "eyas launch CONFIG.toml --host HOST")
    # The line itself runs; the config's env is what it *meant* to set, checked in every process it starts.
    return apply_overrides(replace(imported.config(as_intended=True), shell_line=args.from_shell), args)
