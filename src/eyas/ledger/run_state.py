"""Whether the process that recorded a run still runs, so a run left "running" by a killed launcher is closed.

Usage:
    ledger.start_run(...) stores launcher_identity(); every open of the ledger asks launcher_gone() of each run
    still "running", and server_still_running() of those that started a server.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from eyas.launch import procprobe


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def launcher_identity(pid: int | None = None) -> dict[str, Any]:
    """Enough to tell later whether this process still runs: host, boot, pid and the pid's start time."""
    pid = os.getpid() if pid is None else pid
    st = procprobe.stat(pid) or {}
    return {"pid": pid, "hostname": socket.gethostname(), "boot_id": _boot_id(), "starttime": st.get("starttime")}


def launcher_gone(launcher: dict[str, Any]) -> bool:
    """True when the process that recorded a run on this machine no longer runs; False when alive or unknowable
    (recorded on another machine, or by an eyas that did not record its launcher)."""
    if not launcher.get("pid") or launcher.get("hostname") != socket.gethostname():
        return False
    if launcher.get("boot_id") and launcher["boot_id"] != _boot_id():
        return True  # the machine rebooted since
    st = procprobe.stat(launcher["pid"])
    return st is None or st["state"] in ("Z", "X") or st["starttime"] != launcher.get("starttime")


def server_still_running(kind: str, config: dict, results: dict) -> bool | None:
    """Whether the server an abandoned run started is still up: None where this machine cannot tell."""
    if kind == "serve":
        return False  # the launcher was the server
    launch = config.get("launch") or {}
    if launch.get("via") == "ssh":
        return None  # over ssh: `eyas remote status ID` asks the host
    sid = results.get("server_pid")
    return bool(sid) and bool(procprobe.session(int(sid)))
