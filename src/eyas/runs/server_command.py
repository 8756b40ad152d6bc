"""What a recorded run says about its server: the command it ran, whether it started, the host's login env.

Usage: argv, how = server_command(run); never_started(run); login_env(run)

A launch recorded through `eyas launch --from-shell --run` ran `bash -c LINE`: its server command is the program
that line starts, read the way bash reads it, so it compares option by option with a launch of the same server
from a spec. A bench run's own argv is the client's (`eyas bench --url ...`); its server is the process that
listened on the port, when the bench recorded one.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from eyas.errors import EyasError
from eyas.runs.record import RunRecord

_SHELLS = ("bash", "sh", "zsh", "dash")


def _from_shell_line(line: str) -> list[str] | None:
    from eyas.runs.shell import parse_shell_line

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
    if isinstance(server, dict):
        if isinstance(server.get("argv"), list):
            return [str(a) for a in server["argv"]], "server process"
        if isinstance(server.get("cmdline"), str) and server["cmdline"].strip():
            return server["cmdline"].split(), "server process"
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
