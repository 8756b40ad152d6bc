"""What a serving host really has, read by the host's own Python: the same file runs here and over ssh.

Usage (the source is fed on stdin, so the host needs nothing but a Python):
    python - probe PROGRAM MODULE  < hostprobe.py   -> versions, hardware, base and login environment, is PROGRAM/
                                                       MODULE there
    python - procs SID             < hostprobe.py   -> pid, command line and starting environment of every process
    python - stop SID TIMEOUT      < hostprobe.py   -> SIGTERM the session, SIGKILL what is left after TIMEOUT s
    python - fingerprint PATH DIR  < hostprobe.py   -> sha256 of a model or draft's contents (digests cached in DIR)

The probe runs the way a command typed after `ssh host` runs, so its environment is the host's login environment
(sshd SetEnv, ~/.ssh/environment, what the login shell's startup files export): what a hand launch there gets.

Servers are started in a session of their own (setsid), so "the server" is every live process whose session id is
the leader's pid: SGLang schedulers, vLLM workers, eyas TP workers, and anything a shell line backgrounded with `&`
or `nohup`, which a walk of the leader's children would miss once the leader has exited.

Stdlib only, and eyas only when the host has it (versions and hardware then come from eyas itself, so a launch
record and a local bench record describe one machine with the same keys): the host may have only SGLang or vLLM.
"""

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

# The variables a launched server inherits from the login that starts it; every other one comes from the config.
# Anything that steers results (NCCL_*, CUDA_VISIBLE_DEVICES, SGLANG_*, ...) is deliberately not here.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TMPDIR",
            "TZ", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "PYTHONPATH", "HF_HOME", "HF_HUB_CACHE",
            "HF_TOKEN", "XDG_CACHE_HOME", "EYAS_HOME")
POLL_S = 0.1
# Set per connection or per shell, not by the host: they differ between two logins that are otherwise the same.
_PER_LOGIN = ("SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "PWD", "OLDPWD", "SHLVL", "_",
              "XDG_SESSION_ID", "MAIL", "MOTD_SHOWN")
# Files whose bytes decide what a model computes; logs and optimizer dumps next to them only get name + size,
# so a growing log file does not change a checkpoint's identity.
CONTENT_SUFFIXES = {".json", ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model", ".txt", ".py", ".jinja",
                    ".tiktoken"}


def base_env(environ=None):
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in BASE_ENV if k in environ}


def login_env(environ=None):
    """This process's environment without what each connection sets for itself: the host's login environment."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in _PER_LOGIN}


def hash_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def _cached_digest(conn, path, st):
    """sha256 of one file, keyed by (resolved path, size, mtime_ns): re-fingerprinting 600 GB is free."""
    key = str(path.resolve())
    row = conn.execute("SELECT size, mtime_ns, sha256 FROM digests WHERE path = ?", (key,)).fetchone()
    if row and row[0] == st.st_size and row[1] == st.st_mtime_ns:
        return row[2]
    digest = hash_file(path)
    conn.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?)", (key, st.st_size, st.st_mtime_ns, digest))
    return digest


def fingerprint(path, cache_dir):
    """A sha256 naming the contents of a model or draft directory (or one file); hidden files are ignored.

    The same bytes give the same fingerprint on any machine and under any path, so a copy is recognised as the
    same weights and a retrained draft written over the same path is not.
    """
    root = Path(path)
    if root.is_file():
        files = [(root.name, root)]
    else:
        files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(Path(cache_dir) / "fingerprints.db"), timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute("CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                     "sha256 TEXT)")
        h = hashlib.sha256()
        for rel, p in files:
            st = p.stat()
            content = _cached_digest(conn, p, st) if p.suffix in CONTENT_SUFFIXES else ""
            h.update(f"{rel}\0{st.st_size}\0{content}\n".encode())
    finally:
        conn.close()
    return h.hexdigest()


def _stat(pid):
    """(state, pgrp, session) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or ')': split after the last one.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[2]), int(fields[3])


def session_pids(sid):
    """Live members of session `sid`, leader first. Zombies are left out: they run nothing and have no environ."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st and st[2] == sid and st[0] not in ("Z", "X"):
                pids.append(int(name))
    return sorted(pids, key=lambda p: (p != sid, p))


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def processes(sid):
    out = []
    for pid in session_pids(sid):
        proc = {"pid": pid}
        try:
            proc["cmdline"] = " ".join(a.decode(errors="replace") for a in _read(f"/proc/{pid}/cmdline").split(b"\0")
                                       if a)
            env = {}
            for entry in _read(f"/proc/{pid}/environ").split(b"\0"):
                key, sep, value = entry.partition(b"=")
                if sep:
                    env[key.decode(errors="replace")] = value.decode(errors="replace")
            proc["env"] = env
        except OSError as e:  # exited meanwhile, or another user's process
            proc["error"] = e.strerror or type(e).__name__
        out.append(proc)
    return out


def _signal(pids, sig):
    groups = {(_stat(p) or (None, None, None))[1] for p in pids} - {None, 0, os.getpgrp()}
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for pid in pids:  # members that moved to a group of their own
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _wait_gone(sid, timeout):
    deadline = time.monotonic() + timeout
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return session_pids(sid)


def stop(sid, timeout):
    """SIGTERM every process of the session (servers drain and exit), SIGKILL whatever is left after `timeout`."""
    pids = session_pids(sid)
    if not pids:
        return {"was_running": False, "killed": []}
    _signal(pids, signal.SIGTERM)
    left = _wait_gone(sid, timeout)
    if left:
        _signal(left, signal.SIGKILL)
        _wait_gone(sid, 5.0)
    return {"was_running": True, "killed": left, "left": session_pids(sid)}


def _dist_version(dist):
    try:
        import importlib.metadata

        return importlib.metadata.version(dist)
    except Exception:
        return None


def _versions_without_eyas():
    out = {"python": platform.python_version()}
    for dist in ("transformers", "tokenizers", "safetensors", "triton", "flashinfer-python", "sglang", "vllm",
                 "torch", "eyas"):
        out[dist] = _dist_version(dist)
    return {k: v for k, v in out.items() if v}


def _hardware_without_eyas():
    out = {"hostname": platform.node(), "kernel": platform.release(), "cpu_count": os.cpu_count()}
    for path, key, prefix in (("/proc/cpuinfo", "cpu_model", "model name"),
                              ("/proc/meminfo", "memory_gib", "MemTotal:")):
        try:
            line = next(ln for ln in open(path).read().splitlines() if ln.startswith(prefix))
            out[key] = line.split(":", 1)[1].strip() if key == "cpu_model" else round(int(line.split()[1]) / 2**20, 1)
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        fields = ["index", "name", "memory.total", "driver_version", "pci.bus_id"]
        try:
            text = subprocess.run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10).stdout
            topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            text, topo = "", ""
        gpus = [dict(zip(fields, [c.strip() for c in line.split(",")])) for line in text.splitlines() if line.strip()]
        out.update(gpus=gpus, gpu_count=len(gpus), gpu_topology=topo,
                   gpu_names=", ".join(sorted({g.get("name", "?") for g in gpus})))
    return {k: v for k, v in out.items() if v not in (None, "", [])}


def _eyas_environment():
    """The host's eyas.launch.environment, or None where the host has no eyas, or an eyas laid out without it.

    Found at run time on the host: a plugin import, not a dependency of this file (eyas.launch.environment itself
    fingerprints weights with this file's code). The host's eyas may be older than the one sending this probe.
    """
    try:
        return importlib.import_module("eyas.launch.environment")
    except ModuleNotFoundError as e:
        if e.name in ("eyas", "eyas.launch", "eyas.launch.environment"):
            return None
        raise


def probe(program, module):
    environment = _eyas_environment()
    if environment is not None:
        vers, hw = environment.versions(), environment.hardware()
    else:
        vers, hw = _versions_without_eyas(), _hardware_without_eyas()
    return {"home": os.path.expanduser("~"), "hostname": platform.node(), "python": sys.executable,
            "program": shutil.which(program) if program != "-" else None,
            "module": (importlib.util.find_spec(module) is not None) if module != "-" else None,
            "base_env": base_env(), "login_env": login_env(), "versions": vers, "hardware": hw}


def main(argv):
    action, args = argv[0], argv[1:]
    if action == "probe":
        result = probe(args[0], args[1])
    elif action == "procs":
        result = processes(int(args[0]))
    elif action == "stop":
        result = stop(int(args[0]), float(args[1]))
    elif action == "fingerprint":
        path = os.path.expanduser(args[0])
        try:
            result = {"sha256": fingerprint(path, os.path.expanduser(args[1]))} if os.path.exists(path) else {
                "error": "no such file or directory"}
        except (OSError, sqlite3.Error) as e:
            result = {"error": str(e)}
    else:
        raise SystemExit(f"hostprobe: unknown action {action!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
