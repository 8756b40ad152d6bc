"""Where a launched server runs: this machine. `eyas.launch.remote.SshHost` is the same interface over ssh.

Usage: host = LocalHost(); facts = host.probe(python, program, module); handle = host.start(argv, env, run_id)

A host starts the server in a session of its own with an exact environment (no shell, no inheritance beyond the
base variables), and answers for that session: is it alive, what did each process start with, stop it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.paths import eyas_home
from eyas.launch import hostprobe

PROBE_SOURCE = Path(hostprobe.__file__).read_bytes()


@dataclass
class Handle:
    """A started server: its session id (the leader's pid) and where its files are."""

    sid: int
    workdir: str
    log: str


def workdir_for(base: str, run_id: str) -> str:
    return f"{base.rstrip('/')}/{run_id}"


class LocalHost:
    via = "local"

    def __init__(self, workdir_base: str | None = None):
        self.workdir_base = workdir_base or str(eyas_home() / "launches")
        self._procs: dict[int, subprocess.Popen] = {}

    @property
    def name(self) -> str | None:  # the ledger's host column; None means this machine's name
        return None

    def http_host(self, bind_host: str) -> str:
        return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host

    def config(self) -> dict:
        return {"via": self.via, "workdir_base": self.workdir_base}

    def default_python(self) -> str:
        return sys.executable

    def server_base_env(self, facts: dict) -> dict[str, str]:
        """What the server has before the config's variables: the base variables of this login, nothing else."""
        return dict(facts["base_env"])

    def fingerprint(self, path: str, cache_dir: Path) -> str | None:
        """The sha256 of a model or draft's contents; None for what is not a local path (a hub id)."""
        local = os.path.expanduser(path)
        return hostprobe.fingerprint(local, cache_dir) if os.path.exists(local) else None

    def probe(self, python: str, program: str, module: str | None) -> dict:
        python, program = os.path.expanduser(python), os.path.expanduser(program)
        if shutil.which(python) is None:
            raise EyasError(f"no Python at {python}: set `python` in the launch config (or --python) to the server's "
                            f"interpreter")
        try:
            done = subprocess.run([python, "-", "probe", program, module or "-"], input=PROBE_SOURCE,
                                  capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise EyasError(f"cannot run {python}: {e}") from None
        return parse_probe(done.returncode, done.stdout, done.stderr, python, "this machine")

    def start(self, argv: list[str], env: dict[str, str], run_id: str) -> Handle:
        workdir = Path(workdir_for(self.workdir_base, run_id))
        workdir.mkdir(parents=True, exist_ok=True)
        log = workdir / "server.log"
        with open(log, "ab") as out:
            try:
                # start_new_session: the server and everything it starts share one session id, whatever they do
                # with process groups or parents, so verification and stop find all of them.
                proc = subprocess.Popen([os.path.expanduser(argv[0]), *argv[1:]], env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                raise EyasError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        self._procs[proc.pid] = proc
        (workdir / "server.pid").write_text(f"{proc.pid}\n")
        return Handle(proc.pid, str(workdir), str(log))

    def read_pid(self, workdir: str) -> int | None:
        try:
            return int((Path(workdir) / "server.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _reap(self, sid: int) -> None:
        proc = self._procs.get(sid)
        if proc is not None:
            proc.poll()  # a leader we started must not linger as a zombie of ours

    def alive(self, handle: Handle) -> bool:
        self._reap(handle.sid)
        return bool(hostprobe.session_pids(handle.sid))

    def processes(self, handle: Handle) -> list[dict]:
        self._reap(handle.sid)
        return hostprobe.processes(handle.sid)

    def log_tail(self, handle: Handle, lines: int = 40) -> str:
        try:
            return "\n".join(Path(handle.log).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(cannot read {handle.log}: {e.strerror})"

    def stop(self, handle: Handle, timeout: float) -> dict:
        result = hostprobe.stop(handle.sid, timeout)
        self._reap(handle.sid)
        return result


def parse_probe(rc: int, stdout: bytes, stderr: bytes, python: str, where: str) -> dict:
    last = next((ln for ln in reversed(stderr.decode(errors="replace").splitlines()) if ln.strip()), "")
    if rc == 127:
        raise EyasError(f"no Python at {python} on {where} ({last.strip()}): set `python` in the launch config "
                        "or --python")
    if rc != 0:
        raise EyasError(f"{python} on {where} failed to report its versions: {last.strip() or f'exit {rc}'}")
    try:
        return json.loads(stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise EyasError(f"{python} on {where} printed no report: {stdout[-200:]!r}") from None


def check_probe(facts: dict, program: str, module: str | None, python: str, where: str) -> None:
    """One clear line when the host cannot run the server at all, before anything is recorded."""
    if module and facts.get("module") is False:
        raise EyasError(f"{python} on {where} cannot import {module}: install it there, or point `python` at the "
                        f"interpreter that has it")
    if facts.get("program") is None and program != python:
        raise EyasError(f"{program} is not on the PATH on {where}")
