"""`eyas launch`: start a server from a launch config, prove its environment reached every process, bench, record.

Usage:
    plan = plan_for(config, host)
    outcome = launch(plan, host, ledger)      # -> Outcome(run_id, ok, results)

One flow for every backend and host: check the host can run it (nothing is recorded if not), record the run,
start the server with exactly base env + config env (+ the environment hook, eyas.launch.envhook) in a session of its
own, wait for /health (a dead server shows its log tail), read the starting environment of every process in that
session (its own snapshot, else /proc/PID/environ) and check each requested variable, make sure the process
listening on the port is one of them, record them all as workers, run the bench if the config has one, then stop
the session (SIGTERM, SIGKILL after a timeout).
A run whose environment did not arrive is recorded as failed, bench numbers included: it is exactly the run the
ledger must never offer as "best".
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from eyas.errors import EyasError
from eyas.launch.environment import REDACTED, filtered_env, is_secret
from eyas.launch import envhook
from eyas.launch.launch_backends import build_command
from eyas.launch.launch_host import Handle, check_probe, workdir_for
from eyas.launch.launch_config import LaunchConfig
from eyas.launch.procenv import EnvCheck, EnvReport, ProcessEnv
from eyas.shell.shell import clip_command

HEALTH_POLL_S = 0.5
ALIVE_POLL_S = 2.0  # over ssh every liveness check is a round trip


@dataclass
class Plan:
    """What to execute and which environment every process must end up with."""

    config: LaunchConfig
    argv: list[str]
    env: dict[str, str]  # passed on top of the base variables (empty for a shell line: it sets its own)
    verify: dict[str, str]  # what each process must have
    python: str  # interpreter used for the probe (and the server, for eyas/sglang)
    kind: str = "launch"
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. {"replay_of": "12-..."} or tune sweep labels


class LaunchFailed(EyasError):
    """A launch that went wrong after it was recorded (now as failed); carries the run id."""

    def __init__(self, message: str, run_id: str):
        super().__init__(message)
        self.run_id = run_id


@dataclass
class Outcome:
    run_id: str
    ok: bool
    results: dict[str, Any]
    report: EnvReport | None = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plan_for(config: LaunchConfig, host, kind: str = "launch", **extra: Any) -> Plan:
    python = config.python or host.default_python()
    if config.shell_line is not None:
        return Plan(config, ["bash", "-c", config.shell_line], {}, dict(config.env), python, kind, dict(extra))
    return Plan(config, build_command(config, python), dict(config.env), dict(config.env), python, kind, dict(extra))


def _required_module(plan: Plan) -> str | None:
    if plan.argv[:1] != [plan.python]:
        return None
    return {"eyas": "eyas", "sglang": "sglang", "vllm": "vllm"}[plan.config.backend]


def _port_in_use(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def health_url(plan: Plan, host) -> str:
    return f"http://{host.http_host(plan.config.host)}:{plan.config.port}"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(host, handle: Handle, url: str, timeout: float) -> float:
    start = time.monotonic()
    next_alive = start
    while not _healthy(url):
        now = time.monotonic()
        if now >= next_alive:
            if not host.alive(handle):
                log(f"--- last lines of {handle.log} ---\n{host.log_tail(handle)}\n---")
                raise EyasError(f"the server exited before {url}/health answered (log: {handle.log})")
            next_alive = now + ALIVE_POLL_S
        if now - start > timeout:
            raise EyasError(f"{url}/health did not answer within {timeout:g} s (log: {handle.log})")
        time.sleep(HEALTH_POLL_S)
    return time.monotonic() - start


def recordable(env: dict[str, str], requested: dict[str, str]) -> dict[str, str]:
    """The variables worth keeping (filtered_env's families) plus every requested one, secrets redacted."""
    out = filtered_env(env)
    out.update({k: REDACTED if is_secret(k) else env[k] for k in requested if k in env})
    return dict(sorted(out.items()))


def env_report(processes: list[dict], required: dict[str, str], root: int) -> EnvReport:
    out = []
    for p in processes:
        proc = ProcessEnv(p["pid"], p.get("cmdline", ""), source=p.get("env_source", "proc"))
        if "error" in p:
            proc.error = p["error"]
        else:
            proc.checks = [EnvCheck(k, v, p["env"].get(k)) for k, v in required.items()]
            proc.observed = recordable(p["env"], required)
        out.append(proc)
    return EnvReport(root, dict(required), out)


def port_holder(host, port: int) -> str:
    """`pid 123 (vllm serve ...)` of what listens on `port` on the host, for an error message."""
    owner = envhook.probe(host, "port", str(port))
    if not owner.get("listeners"):
        return "a process eyas cannot see"
    line = next((p["cmdline"] for p in owner["processes"] if p["pid"] == owner["root"]), "")
    return f"pid {owner['root']}" + (f" ({line[:80]})" if line else "")


def check_listener(listening: list[int], report: EnvReport, port: int, where: str, sid: int, holder) -> None:
    """The process answering on the port must be one the launch started, or its numbers are another server's."""
    mine = {p.pid for p in report.processes}
    if not listening:
        raise EyasError(f"no process on {where} is seen listening on port {port} although /health answers there: "
                        f"cannot tell which server would be measured")
    if not mine & set(listening):
        raise EyasError(f"port {port} on {where} is held by {holder()}, not by the launched server (session {sid}): "
                        f"another server answers there; stop it or pick another port")


def record_processes(ledger, run_id: str, report: EnvReport, procs: list[dict], host_name: str | None) -> None:
    """Each readable process as a worker; an unreadable one is left out, so it never reads as "all unset"."""
    by_pid = {p["pid"]: p for p in procs}
    for p in report.processes:
        if p.error:
            continue
        info = {"pid": p.pid, "cmdline": p.cmdline, "host": host_name, "env_source": p.source}
        info.update({k: by_pid[p.pid][k] for k in ("argv", "proc_environ") if k in by_pid.get(p.pid, {})})
        ledger.add_worker_env(run_id, f"pid{p.pid}", p.observed, info)


def env_problems(report: EnvReport) -> list[str]:
    problems = [f"{c.key}={c.expected}: {'unset' if c.observed is None else repr(c.observed)} in pid {p.pid} "
                f"({p.cmdline[:60]})" for p, c in report.mismatches()]
    problems += [f"pid {p.pid}: environment unreadable ({p.error})" for p in report.processes if p.error]
    if not report.processes:
        problems.append("no server process left to check")
    return problems


def bench_results(plan: Plan, url: str) -> dict:
    """The load generator run on the config's [bench] table (a launch BenchConfig, which becomes eyas.bench's)."""
    from eyas.bench.client import run_benchmark
    from eyas.bench.config import BenchConfig
    from eyas.bench.report import ledger_results

    b = plan.config.bench
    load = BenchConfig(url=url, dataset=b.dataset, num_prompts=b.num_prompts, concurrency=b.concurrency,
                       max_tokens=b.max_tokens, progress=False)
    result = run_benchmark(load)
    log(result.table())
    return ledger_results(result)


def _fingerprint(path: str | None, host, ledger) -> str | None:
    if not path:
        return None
    try:  # on the host that serves it: over ssh for a remote launch (digests cached there by size and mtime)
        return host.fingerprint(path, ledger.path.parent)
    except (OSError, EyasError):  # an unreadable file must not stop the run from being recorded
        return None


def launch(plan: Plan, host, ledger, *, keep_running: bool = False,
           launched_by: list[str] | None = None) -> Outcome:
    """Run `plan` on `host` and record it in `ledger` (an eyas.ledger Ledger, passed in: the ledger package sits
    above this one, since it replays and tunes through it)."""
    config, url = plan.config, health_url(plan, host)
    where = host.name or "this machine"
    module = _required_module(plan)
    facts = host.probe(plan.python, plan.argv[0], module)
    check_probe(facts, plan.argv[0], module, plan.python, where)
    if _port_in_use(host.http_host(config.host), config.port):
        raise EyasError(f"port {config.port} on {where} already answers ({port_holder(host, config.port)}): stop that "
                        f"server or pick another port")

    env = {**facts["base_env"], **plan.env}
    # What each process should get: the base variables, or the host's login environment where it inherits that.
    recorded_env = recordable({**host.server_base_env(facts), **plan.verify}, plan.verify)
    how = {**host.config(), "python": plan.python, "env_passed_by": "shell line" if config.shell_line else "process",
           **plan.extra}
    run_id = ledger.start_run(plan.kind, plan.argv, facts["home"] if host.via != "local" else os.getcwd(), recorded_env,
                              {**config.to_dict(), "launch": how}, config.model, config.draft,
                              versions=facts["versions"], hardware=facts["hardware"],
                              model_fingerprint=_fingerprint(config.model, host, ledger),
                              draft_fingerprint=_fingerprint(config.draft, host, ledger), host=host.name)
    results: dict[str, Any] = {"launched_by": " ".join(launched_by or sys.argv)}
    status, handle, report, failure = "failed", None, None, None
    log(f"eyas: run {run_id}: starting {config.backend} on {where}: {clip_command(plan.argv)}")
    try:
        workdir = workdir_for(host.workdir_base, run_id)
        envhook.install(host, workdir)
        env, hook_vars = envhook.with_hook(env, workdir)
        handle = host.start(plan.argv, env, run_id)
        results.update(server_pid=handle.sid, log=handle.log, workdir=handle.workdir)
        ledger.note_running(run_id, results)
        results["startup_s"] = round(wait_healthy(host, handle, url, config.startup_timeout_s), 2)
        procs = envhook.read_session(host, handle.sid, workdir, hook_vars)
        report = env_report(procs, plan.verify, handle.sid)
        check_listener(envhook.probe(host, "listeners", str(config.port)), report, config.port, where, handle.sid,
                       lambda: port_holder(host, config.port))
        record_processes(ledger, run_id, report, procs, host.name)
        problems = env_problems(report)
        results.update(env_verified=not problems, processes=len(report.processes),
                       env_sources=dict(sorted(Counter(p.source for p in report.processes if not p.error).items())))
        if plan.verify:
            log(report.render())
        if problems:
            results["env_problems"] = problems[:20]
            log(f"eyas: the requested environment did not reach every server process: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        if config.bench:
            results.update(bench_results(plan, url))
        status = "ok" if not problems and results.get("completed", 1) else "failed"
    except KeyboardInterrupt:
        status, failure = "interrupted", KeyboardInterrupt()
    except Exception as e:  # recorded, then re-raised: a crash must not leave a "running" run behind
        results["error"] = str(e)[:500]
        failure = e
    finally:
        if handle is not None and (not keep_running or status != "ok"):
            stopped = host.stop(handle, config.stop_timeout_s)
            results["stopped"] = "killed" if stopped.get("killed") else "terminated"
        elif handle is not None:
            results["stopped"] = "kept running"
        try:
            ledger.finish_run(run_id, status, results)
        except EyasError as e:  # `eyas remote stop` recorded it as stopped meanwhile
            log(f"eyas: run {run_id}: {e}")
    if isinstance(failure, EyasError):
        raise LaunchFailed(f"run {run_id} failed: {failure}", run_id) from failure
    if failure is not None:
        raise failure
    return Outcome(run_id, status == "ok", results, report)
