"""Launch on another machine over ssh: the same launch, with the host's answers fetched through ssh.

Usage: host = SshHost("root@10.1.230.174", ["Port=22"]); launch(plan_for(config, host), host, ledger)

What travels: one generated script, copied with `cat > path` over ssh's stdin (no scp, no quoting of its content
on any command line), holding `exec env 'KEY=value' ... server args`, every word quoted by runs.shell.quote so
a value with spaces, quotes, `$` or a newline arrives byte for byte. The server starts from what a hand launch
over ssh gets, the host's login environment (sshd SetEnv, ~/.ssh/environment, the login shell's exports:
NCCL_SOCKET_IFNAME, CUDA_HOME, LD_LIBRARY_PATH...), plus the config's variables; `clean_env` (--clean-env) starts it
from the base variables only (`env -i`). The login environment is recorded beside what the server got.
The script is started with `setsid nohup`, logs to a file on the host and writes its pid (= its session id) next
to it, so it outlives the ssh connection and `eyas remote stop` can still find every process it started.
Everything read back (versions, hardware, each process's /proc/PID/environ, weight fingerprints) comes from
hostprobe.py run by the host's Python, fed on stdin.
"""

from __future__ import annotations

import json
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import PurePosixPath

from eyas.errors import EyasError
from eyas.launch.environment import filtered_env
from eyas.launch.launch_host import PROBE_SOURCE, Handle, LocalHost, parse_probe, workdir_for
from eyas.shell.shell import quote

SSH_CONNECT_TIMEOUT_S = 10
DEFAULT_WORKDIR = "~/.cache/eyas/launches"
_LOOPBACK = ("127.", "localhost", "::1")


def remote_word(word: str) -> str:
    """quote(), except that a leading ~/ still means the remote home (as in `~/ml-env/bin/python3`)."""
    if word == "~":
        return '"$HOME"'
    if word.startswith("~/"):
        return '"$HOME"/' + quote(word[2:])
    return quote(word)


def render_script(argv: list[str], env: dict[str, str], run_id: str, clean_env: bool = False) -> str:
    origin = socket.gethostname()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    assigns = [quote(f"{k}={v}") for k, v in env.items()]
    words = [remote_word(argv[0])] + [quote(a) for a in argv[1:]]
    what = ("env -i: it gets exactly the variables below and nothing else." if clean_env else
            "env: it gets the login environment of an ssh command here, plus the variables below.")
    lines = ["#!/bin/sh",
             f"# Written by `eyas launch` for run {run_id} on {origin}, {when}. Started with setsid nohup, so the",
             f"# server outlives the ssh connection. {what}",
             "echo $$ > server.pid",
             f"exec env {'-i ' if clean_env else ''}\\"] + [f"  {a} \\" for a in assigns] + ["  " + " ".join(words)]
    return "\n".join(lines) + "\n"


class SshHost:
    via = "ssh"

    def __init__(self, target: str, options: list[str] | None = None, workdir_base: str | None = None,
                 python: str | None = None, clean_env: bool = False):
        if not target or target.startswith("-") or any(c.isspace() for c in target):
            raise EyasError(f"--host expects [USER@]HOST, got {target!r}")
        self.target, self.options = target, list(options or [])
        self.hostname = target.rsplit("@", 1)[-1]
        self.workdir_base = workdir_base or DEFAULT_WORKDIR
        self.python = python
        self.clean_env = clean_env
        self.login_env: dict[str, str] | None = None  # read by probe(): what an ssh command on the host gets

    @property
    def name(self) -> str:
        return self.hostname

    def default_python(self) -> str:
        return "python3"

    def http_host(self, bind_host: str) -> str:
        if bind_host.startswith(_LOOPBACK) and not self.hostname.startswith(_LOOPBACK):
            raise EyasError(f"the launch config binds {bind_host}, which {self.hostname} only serves to itself: set "
                            f'host = "0.0.0.0" (or an address of {self.hostname}) so /health can be reached from here')
        return self.hostname if bind_host in ("0.0.0.0", "::", "") else bind_host

    def config(self) -> dict:
        out = {"via": self.via, "target": self.target, "ssh_options": self.options, "workdir_base": self.workdir_base,
               "clean_env": self.clean_env}
        if self.login_env is not None:  # beside what the server got: the diff shows both
            out["login_env"] = filtered_env(self.login_env) | ({"PATH": self.login_env["PATH"]}
                                                               if "PATH" in self.login_env else {})
        return out

    def server_base_env(self, facts: dict) -> dict[str, str]:
        """What the server has before the config's variables: the login environment, or the base ones if clean."""
        return dict(facts["base_env"] if self.clean_env else facts.get("login_env", facts["base_env"]))

    def fingerprint(self, path: str, cache_dir=None) -> str | None:
        """The sha256 of a model or draft's contents, computed on the host; digests are cached there, next to the
        launch directories, by path, size and mtime. None when the path is not there (a hub id)."""
        cache = str(PurePosixPath(self.workdir_base).parent)
        result = self._python("fingerprint", path, cache, timeout=3600)
        return result.get("sha256")

    def ssh_argv(self, command: str) -> list[str]:
        # BatchMode: a refused key fails at once instead of waiting for a password nobody will type.
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
        for opt in self.options:
            argv += ["-o", opt]
        return argv + [self.target, command]

    def ssh(self, command: str, stdin: bytes = b"", timeout: float = 60.0) -> subprocess.CompletedProcess:
        try:
            done = subprocess.run(self.ssh_argv(command), input=stdin, capture_output=True, timeout=timeout)
        except FileNotFoundError:
            raise EyasError("ssh is not installed on this machine") from None
        except subprocess.TimeoutExpired:
            raise EyasError(f"ssh {self.target}: no answer within {timeout:g} s") from None
        if done.returncode == 255:  # ssh's own failure: unreachable, refused key, bad option
            raise EyasError(f"ssh {self.target} failed: {_last_line(done.stderr) or 'exit 255'}")
        return done

    def _python(self, action: str, *args: str, timeout: float = 60.0):
        if self.python is None:
            raise EyasError("internal: the host's Python is unknown (probe first)")
        cmd = " ".join([remote_word(self.python), "-", action, *map(remote_word, args)])
        done = self.ssh(cmd, PROBE_SOURCE, timeout)
        if action == "probe":
            return parse_probe(done.returncode, done.stdout, done.stderr, self.python, self.hostname)
        if done.returncode != 0:
            raise EyasError(f"{self.python} on {self.hostname} failed ({action}): {_last_line(done.stderr)}")
        return json.loads(done.stdout.decode().strip().splitlines()[-1])

    def probe(self, python: str, program: str, module: str | None) -> dict:
        self.python = python
        facts = self._python("probe", program, module or "-", timeout=120)
        if self.workdir_base.startswith("~/"):
            self.workdir_base = facts["home"].rstrip("/") + self.workdir_base[1:]
        self.login_env = facts.get("login_env", {})
        return facts

    def start(self, argv: list[str], env: dict[str, str], run_id: str) -> Handle:
        d = workdir_for(self.workdir_base, run_id)
        done = self.ssh(f"mkdir -p {remote_word(d)} && cat > {remote_word(d)}/launch.sh",
                        render_script(argv, env, run_id, self.clean_env).encode())
        if done.returncode != 0:
            raise EyasError(f"cannot write the launch script to {self.hostname}:{d}: {_last_line(done.stderr)}")
        # The subshell and the redirections let ssh return at once; the bounded loop waits for the pid file.
        start = (f"cd {remote_word(d)} && (setsid nohup sh launch.sh > server.log 2>&1 < /dev/null &) && i=0 && "
                 "while [ ! -s server.pid ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; cat server.pid")
        done = self.ssh(start)
        try:
            sid = int(done.stdout.decode().strip())
        except ValueError:
            raise EyasError(f"the server on {self.hostname} did not start: {_last_line(done.stderr) or 'no pid'}"
                            ) from None
        return Handle(sid, d, f"{d}/server.log")

    def read_pid(self, workdir: str) -> int | None:
        done = self.ssh(f"cat {remote_word(workdir)}/server.pid")
        try:
            return int(done.stdout.decode().strip())
        except ValueError:
            return None

    def alive(self, handle: Handle) -> bool:
        return bool(self.processes(handle))

    def processes(self, handle: Handle) -> list[dict]:
        return self._python("procs", str(handle.sid))

    def log_tail(self, handle: Handle, lines: int = 40) -> str:
        done = self.ssh(f"tail -n {int(lines)} {remote_word(handle.log)}")
        return done.stdout.decode(errors="replace") or _last_line(done.stderr)

    def stop(self, handle: Handle, timeout: float) -> dict:
        return self._python("stop", str(handle.sid), str(timeout), timeout=timeout + 60)


def _last_line(stderr: bytes) -> str:
    return next((ln.strip() for ln in reversed(stderr.decode(errors="replace").splitlines()) if ln.strip()), "")


def host_from_config(launch: dict):
    """The host a recorded launch ran on, ready to be asked about (or to run the same thing again)."""
    if launch.get("via") == "ssh":
        return SshHost(launch["target"], launch.get("ssh_options"), launch.get("workdir_base"), launch.get("python"),
                       bool(launch.get("clean_env")))
    return LocalHost(launch.get("workdir_base"))
