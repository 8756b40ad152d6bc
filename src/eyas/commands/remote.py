"""`eyas remote`: look after a server that `eyas launch --keep-running` left up, here or over ssh.

Usage: eyas remote status 12      (processes alive, /health)
       eyas remote logs 12 -n 100
       eyas remote stop 12        (SIGTERM to every process of its session, SIGKILL after the config's stop timeout;
                                   the run records it, and a run still open becomes "stopped")

Everything needed is in the run record: the host and ssh options, the Python that reads /proc there, and the work
directory whose server.pid names the session, so this works after the launching ssh connection (or the launching
`eyas launch`) is long gone.
"""

from __future__ import annotations

import argparse
import time

import httpx

from eyas.errors import EyasError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="ledger file (default: $EYAS_HOME/runs.db)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("status", help="are the server's processes alive, does /health answer")
    s.add_argument("id")
    s = sub.add_parser("logs", help="the last lines of the server's log")
    s.add_argument("id")
    s.add_argument("-n", "--lines", type=int, default=40)
    s = sub.add_parser("stop", help="stop every process the launch started")
    s.add_argument("id")
    s.add_argument("--timeout", type=float, help="seconds between SIGTERM and SIGKILL (default: the launch config's)")


def locate(run):
    """(host, handle, config) of a launched run, from its record alone."""
    from eyas.launch.launch_host import Handle, workdir_for
    from eyas.launch.launch_config import LaunchConfig
    from eyas.launch.remote import host_from_config

    if "launch" not in run.config:
        raise EyasError(f"run {run.run_id} is a {run.kind} run, not one started by `eyas launch`")
    launch = run.config["launch"]
    host = host_from_config(launch)
    workdir = run.results.get("workdir") or workdir_for(launch["workdir_base"], run.run_id)
    sid = run.results.get("server_pid") or host.read_pid(workdir)
    if sid is None:
        raise EyasError(f"run {run.run_id} never got as far as starting a server (no {workdir}/server.pid)")
    config = LaunchConfig.from_dict({k: v for k, v in run.config.items() if k != "launch"})
    return host, Handle(int(sid), workdir, run.results.get("log") or f"{workdir}/server.log"), config


def run(args: argparse.Namespace) -> int:
    from eyas.ledger.ledger import Ledger

    if args.action == "logs" and args.lines < 1:
        raise EyasError(f"--lines must be >= 1, got {args.lines}")
    if args.action == "stop" and args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise EyasError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    with Ledger.existing(args.db) as ledger:
        record = ledger.get(args.id)
    host, handle, config = locate(record)
    where = host.name or "this machine"
    if args.action == "logs":
        print(host.log_tail(handle, args.lines))
        return 0
    if args.action == "stop":
        result = host.stop(handle, args.timeout or config.stop_timeout_s)
        if result.get("left"):
            raise EyasError(f"processes {result['left']} of session {handle.sid} on {where} survived SIGKILL")
        how = ("nothing was running" if not result["was_running"] else
               "killed after the SIGTERM timeout" if result["killed"] else "stopped with SIGTERM")
        with Ledger.existing(args.db) as ledger:
            status = ledger.record_stop(record.run_id, {"stopped": f"eyas remote stop: {how}",
                                                        "stopped_at": time.time()})
        print(f"run {record.run_id}: {how} on {where} (session {handle.sid}); recorded as {status}")
        return 0
    procs = host.processes(handle)
    url = f"http://{host.http_host(config.host)}:{config.port}/health"
    try:
        health = str(httpx.get(url, timeout=3.0, trust_env=False).status_code)
    except httpx.HTTPError as e:
        health = f"no answer ({type(e).__name__})"
    print(f"run {record.run_id} on {where}: {len(procs)} process(es) in session {handle.sid}; {url}: {health}")
    for p in procs:
        print(f"  {p['pid']}  {p.get('cmdline', '')[:100]}")
    print(f"log: {handle.log}")
    return 0 if procs else 1
