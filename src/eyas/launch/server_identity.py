"""What server a benchmark measured: its own account of itself, and the processes behind its port.

Usage: facts = identify("http://127.0.0.1:8000", host=None); facts.config, facts.model, facts.processes

A bench against a server started by hand recorded only the client's side, so the run that lost 30 tok/s to an
NCCL variable that never reached the workers looked like any other. Here the server is asked (eyas and SGLang:
`GET /server_info`, every resolved server argument; vLLM: `GET /version` and the `*_info` gauges of `/metrics`;
all: `GET /v1/models`), and where its port is on this machine (or on `--host USER@HOST`, over ssh) the process
listening there is found, with its parents (how it was started), its process tree and each process's command line
and starting environment (eyas.launch.procprobe: a retitled process is reported unreadable, never "unset").
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from eyas.launch import envhook, procprobe
from eyas.launch.environment import filtered_env, redact_command

TIMEOUT_S = 5.0
# SGLang's server arguments that decide speed or output; /server_info has them all at the top level.
_INFO_LABELS = re.compile(r'^([a-zA-Z_:][\w:]*_info)\{(.*)\}\s+\S+$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class ServerFacts:
    config: dict[str, Any] = field(default_factory=dict)  # goes to the bench run's config["server"]
    model: str | None = None
    processes: list[dict] = field(default_factory=list)  # readable processes: pid, cmdline, env, env_source
    host: str | None = None


def _get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        r = client.get(url)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


def _json(r: httpx.Response | None) -> Any:
    try:
        return r.json() if r is not None else None
    except ValueError:
        return None


def sglang_facts(info: dict) -> dict:
    """SGLang's /server_info: its scalar server arguments (speculative settings, tp_size, mem_fraction_static,
    ...), version and launch command; the per-rank internal states are runtime counters, left out."""
    return {k: v for k, v in info.items() if k != "internal_states" and (
        v is None or isinstance(v, (str, int, float, bool)) or
        (isinstance(v, list) and all(isinstance(x, (str, int, float, bool)) for x in v)))}


def info_gauges(metrics_text: str) -> dict[str, dict[str, str]]:
    """Prometheus `*_info{label="..."} 1` lines (vLLM's cache and model settings): {metric: labels}."""
    out = {}
    for line in metrics_text.splitlines():
        m = _INFO_LABELS.match(line.strip())
        if m:
            out[m.group(1)] = dict(_LABEL.findall(m.group(2)))
    return out


def ask_server(url: str, api_key: str | None = None) -> tuple[dict, str | None]:
    """(what the server says about itself, the model path it serves) from its HTTP endpoints."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, Any] = {"url": url}
    model = None
    with httpx.Client(timeout=TIMEOUT_S, headers=headers, trust_env=False) as client:
        info = _json(_get(client, url + "/server_info"))
        if isinstance(info, dict) and "workers" in info and "config" in info:
            out.update(backend="eyas", config=info["config"], versions=info.get("versions"),
                       env_check=info.get("env_check"), execution_plan=info.get("execution_plan"))
            model = (info.get("config") or {}).get("model")
        elif isinstance(info, dict) and ("tp_size" in info or "launch_command" in info):
            out.update(backend="sglang", server_args=sglang_facts(info))
            model = info.get("model_path")
        version = _json(_get(client, url + "/version"))
        if isinstance(version, dict) and "version" in version and "backend" not in out:
            out.update(backend="vllm", version=version["version"])
        if out.get("backend") == "vllm":
            metrics = _get(client, url + "/metrics")
            if metrics is not None:
                out["metrics_info"] = info_gauges(metrics.text)
        models = _json(_get(client, url + "/v1/models"))
        if isinstance(models, dict) and models.get("data"):
            first = models["data"][0]
            out["served_model"] = {k: first.get(k) for k in ("id", "root", "max_model_len") if k in first}
            model = model or first.get("root") or first.get("id")
    return out, model


def is_local(hostname: str) -> bool:
    """Whether `hostname` names this machine: an address one of its interfaces holds can be bound to."""
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(hostname, None)}
    except (socket.gaierror, UnicodeError):
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def _without_hook(env: dict[str, str]) -> dict[str, str]:
    """A server `eyas launch` started carries the snapshot hook's variables; they say nothing about the run."""
    snaps = env.get(procprobe.HOOK_VAR)
    if not snaps:
        return env
    workdir = snaps.rsplit("/", 1)[0]
    hook, _ = envhook.folders(workdir)
    return envhook.strip(env, {procprobe.HOOK_VAR: snaps, "PYTHONPATH": hook})


def port_processes(port: int, host=None) -> dict:
    """procprobe's port report, here or over ssh; {} when nothing listens there (or it is not visible)."""
    return envhook.probe(host, "port", str(port))


def identify(url: str, api_key: str | None = None, host=None) -> ServerFacts:
    url = url.rstrip("/")
    said, model = ask_server(url, api_key)
    facts = ServerFacts(model=model, host=host.name if host is not None else None)
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    where = host.name if host is not None else "this machine"
    if host is None and not is_local(parsed.hostname or ""):
        said["processes"] = f"{parsed.hostname} is not this machine: give --host USER@HOST to read its processes"
        facts.config = said
        return facts
    owner = port_processes(port, host)
    if not owner.get("listeners"):
        said["processes"] = f"no process on {where} is seen listening on port {port}"
        facts.config = said
        return facts
    procs = owner["processes"]
    for p in [*procs, *owner.get("parents", [])]:
        p["cmdline"] = redact_command(p["cmdline"])
    said["listener"] = {"host": where, "port": port, "pids": owner["listeners"], "root": owner["root"],
                        "cmdline": next((p["cmdline"] for p in procs if p["pid"] == owner["root"]), ""),
                        "parents": owner.get("parents", []), "processes": len(procs),
                        "env_sources": sorted({p["env_source"] for p in procs if "env" in p})}
    unreadable = [{"pid": p["pid"], "cmdline": p["cmdline"][:200], "why": p["error"]} for p in procs
                  if "env" not in p]
    if unreadable:
        said["listener"]["unreadable"] = unreadable
    for p in procs:
        if "env" in p:
            p["env"] = filtered_env(_without_hook(p["env"]))
    facts.processes = [p for p in procs if "env" in p]
    facts.config = said
    return facts
