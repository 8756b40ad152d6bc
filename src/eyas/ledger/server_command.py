"""What a recorded run says about its server: the command it ran, whether it started, the host's login env.

Usage: argv, how = server_command(run); never_started(run); login_env(run)

A launch recorded through `eyas launch --from-shell --run` ran `bash -c LINE`: its server command is the program
that line starts, read the way bash reads it, so it compares option by option with a launch of the same server
from a config. A bench run's own argv is the client's (`eyas bench --url ...`); its server is the process that
listened on the port, when the bench recorded one.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from eyas.errors import EyasError
from eyas.ledger.record import RunRecord

_SHELLS = ("bash", "sh", "zsh", "dash")


def _from_shell_line(line: str) -> list[str] | None:
    from eyas.shell.shell import parse_shell_line

    try:
        main = parse_shell_line(line).main
    except EyasError:
        return None
    return list(main.argv) if main is not None and main.argv else None


def server_command(run: RunRecord) -> tuple[list[str] | None, str | None]:
    """(the server's argv, how it was started) or (None, None) when the record has no server command."""
    argv = run.argv
    if run.kind in ("launch", "tune"):
        if len(argv) == 3 and PurePosixPath(argv[0]).name in _SHELLS and argv[1] == "-c":
            return _from_shell_line(argv[2]), f"{PurePosixPath(argv[0]).name} -c line"
        return list(argv), "command"
    server = run.config.get("server")
    listener = server.get("listener") if isinstance(server, dict) else None
    if isinstance(listener, dict) and isinstance(listener.get("cmdline"), str) and listener["cmdline"].strip():
        return listener["cmdline"].split(), "server process"  # the process `eyas bench` found on the port
    if run.kind == "bench":  # /proc's command line, joined with spaces: split back, as exactly as it allows
        first = run.workers[0].info.get("cmdline") if run.workers else None
        return (first.split(), "server process") if first else (None, None)
    return list(argv), "command"


def never_started(run: RunRecord) -> bool:
    """A launch whose server never answered /health: nothing measured about it is a cause of anything."""
    return (run.kind in ("launch", "tune") and run.status in ("failed", "interrupted")
            and "startup_s" not in run.results and not run.workers)


def login_env(run: RunRecord) -> dict[str, str]:
    """The host's login environment recorded beside a remote launch (what an ssh command there gets)."""
    launch = run.config.get("launch")
    env = launch.get("login_env") if isinstance(launch, dict) else None
    return dict(env) if isinstance(env, dict) else {}


# Process ids and the chain of parents of the server a bench found: they change with every start of one server.
_PER_START = ("pids", "root", "parents")


def stable_config(config: dict) -> dict:
    """A run's config without what differs between two starts of one configuration (pids, the login env, which
    the diff shows in a section of its own)."""
    out = dict(config)
    server = out.get("server")
    if isinstance(server, dict) and isinstance(server.get("listener"), dict):
        listener = {k: v for k, v in server["listener"].items() if k not in _PER_START}
        out["server"] = {**server, "listener": listener}
    launch = out.get("launch")
    if isinstance(launch, dict) and "login_env" in launch:
        out["launch"] = {k: v for k, v in launch.items() if k != "login_env"}
    return out

