"""Give a launched server a second channel for its environment, and keep that channel out of what is recorded.

Usage:
    install(host, workdir)                       # writes WORKDIR/envhook/sitecustomize.py on the serving host
    env, added = with_hook({**base, **spec_env}, workdir)
    ...start the server with env...
    procs = read_session(host, sid, workdir)     # procprobe's answer, the hook's own variables taken out again

Two things make the environment of a retitled process (vLLM EngineCore/workers, SGLang scheduler/detokenizer)
readable: SPT_NOENV=1, which tells the setproctitle library to leave the environment's memory alone, and the
snapshot each Python process writes at interpreter start (eyas.launch.snapshot_site), which covers a process that
ignores or drops SPT_NOENV. The hook's variables (its PYTHONPATH entry, EYAS_ENV_SNAPSHOT_DIR, SPT_NOENV when eyas
added it) differ from run to run or say nothing about the run, so they are removed before anything is compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.errors import EyasError
from eyas.launch import procprobe, snapshot_site

SOURCE = Path(snapshot_site.__file__).read_bytes()
PROBE_SOURCE = Path(procprobe.__file__).read_bytes()


def folders(workdir: str) -> tuple[str, str]:
    """(the folder put on PYTHONPATH, the folder snapshots are written to) inside a launch's work directory."""
    base = workdir.rstrip("/")
    return f"{base}/envhook", f"{base}/envsnap"


def install(host, workdir: str) -> None:
    hook, snaps = folders(workdir)
    if host.via == "local":
        Path(hook).mkdir(parents=True, exist_ok=True)
        Path(snaps).mkdir(parents=True, exist_ok=True)
        (Path(hook) / "sitecustomize.py").write_bytes(SOURCE)
        return
    from eyas.launch.remote import remote_word

    done = host.ssh(f"mkdir -p {remote_word(hook)} {remote_word(snaps)} && cat > {remote_word(hook)}/sitecustomize.py",
                    SOURCE)
    if done.returncode != 0:
        raise EyasError(f"cannot write the environment hook to {host.name}:{hook}: "
                        f"{done.stderr.decode(errors='replace').strip()[-200:]}")


def with_hook(env: dict[str, str], workdir: str) -> tuple[dict[str, str], dict[str, str]]:
    """`env` plus the hook's variables, and the variables as added (for strip)."""
    hook, snaps = folders(workdir)
    added = {procprobe.HOOK_VAR: snaps, "PYTHONPATH": hook}
    if not env.get("SPT_NOENV"):
        added["SPT_NOENV"] = "1"
    out = {**env, **added}
    if env.get("PYTHONPATH"):
        out["PYTHONPATH"] = f"{hook}:{env['PYTHONPATH']}"
    return out, added


def strip(env: dict[str, str], added: dict[str, str]) -> dict[str, str]:
    """`env` as it would be without the hook: its PYTHONPATH entry and the variables it set removed."""
    out = dict(env)
    for key, value in added.items():
        if key == "PYTHONPATH" and key in out:
            rest = [p for p in out[key].split(":") if p != value]
            if rest:
                out[key] = ":".join(rest)
            else:
                del out[key]
        elif out.get(key) == value:
            del out[key]
    return out


def probe(host, action: str, *args: str) -> object:
    """procprobe's answer for `action` on the serving host (this machine, or over ssh with the host's Python)."""
    if host is None or host.via == "local":
        return procprobe.answer(action, list(args))
    from eyas.launch.remote import remote_word

    python = host.python or "python3"
    done = host.ssh(" ".join([remote_word(python), "-", action, *map(remote_word, args)]), PROBE_SOURCE)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise EyasError(f"{python} on {host.name} could not read its processes: {why[-1] if why else done.returncode}")
    try:
        return json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise EyasError(f"{python} on {host.name} printed no process report") from None


def read_session(host, sid: int, workdir: str, added: dict[str, str]) -> list[dict]:
    """Every process of a launched server's session, each environment without the hook's variables."""
    procs = probe(host, "session", str(sid), folders(workdir)[1])
    for p in procs:
        if "env" in p:
            p["env"] = strip(p["env"], added)
    return procs
