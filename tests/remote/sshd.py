"""A real OpenSSH server on 127.0.0.1 for the remote-launch tests: throwaway host and user keys, started and
stopped by the tests themselves."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from eyas.dist.launch import free_port

# sshd's SetEnv for every login to this test server.
LOGIN_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)


def unavailable() -> str | None:
    """Why these tests cannot run here, or None."""
    if SSHD is None:
        return "OpenSSH server not installed (apt-get install -y openssh-server)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "OpenSSH client (ssh, ssh-keygen) not installed"
    if os.geteuid() != 0:
        return "sshd needs root to log a user in"
    return None


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


class Sshd:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host_key = keygen(root / "host_key")
        self.user_key = keygen(root / "user_key")
        self.other_key = keygen(root / "other_key")  # never authorized
        (root / "authorized_keys").write_text((root / "user_key.pub").read_text())
        os.chmod(root / "authorized_keys", 0o600)
        self.config = root / "sshd_config"
        self.config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {root / 'authorized_keys'}", f"PidFile {root / 'sshd.pid'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "LogLevel ERROR",
            # What a GPU host sets for every login, as the variables a hand launch over ssh inherits.
            f"SetEnv {' '.join(f'{k}={v}' for k, v in LOGIN_ENV.items())}", ""]))
        self.proc = None

    def start(self) -> "Sshd":
        Path("/run/sshd").mkdir(exist_ok=True)  # Debian's privilege-separation directory
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.root / "sshd.log", "ab"), start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sshd did not start: " + (self.root / "sshd.log").read_text())
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill the listener and every connection it serves (its session), as a dropped network would."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.proc = None

    def options(self, key: Path | None = None, port: int | None = None) -> list[str]:
        opts = [f"Port={port or self.port}", f"IdentityFile={key or self.user_key}", "IdentitiesOnly=yes",
                "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]
        return [x for o in opts for x in ("--ssh-option", o)]
