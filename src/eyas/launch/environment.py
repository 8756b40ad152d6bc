"""Capture what determines a result besides the command line: environment, versions, hardware, weights.

Usage: filtered_env(os.environ); versions(); hardware(); path_fingerprint("/models/llama")

The 94 tok/s run was fast because of six NCCL variables nobody wrote down. Every capture here must run on a
machine without a GPU, git or torch and never crash: a missing piece is recorded as absent, not raised.
torch is imported only inside versions(), so importing this module (and `eyas runs list`) stays fast.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from eyas.errors import EyasError
from eyas.paths import eyas_home
from eyas.launch import hostprobe

REDACTED = "<redacted>"

_KEEP_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "EYAS_", "OMP_", "MKL_", "HF_", "TRANSFORMERS_",
                  "SGLANG_", "VLLM_", "NVIDIA_")
_KEEP_NAMES = {"LD_LIBRARY_PATH", "PYTHONPATH", "TOKENIZERS_PARALLELISM"}
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "CREDENTIALS", "PASSWD")


def is_secret(key: str) -> bool:
    """HF_TOKEN, EYAS_API_KEY, NCCL_IB_PKEY are secrets; TOKENIZERS_PARALLELISM is not.

    Matched per `_`-separated part (a part that ends with a secret word), because plain substring matching would
    redact TOKENIZERS_PARALLELISM, one of the variables we most want to see.
    """
    return any(part.endswith(_SECRET_WORDS) for part in key.upper().split("_"))


_ASSIGNMENT = re.compile(r"""(?P<key>[A-Za-z_][A-Za-z0-9_]*)(?P<sep>=|["']?\s*:\s*["']?)(?P<value>[^\s"',}]+)""")


def redact_command(text: str) -> str:
    """A command line with the values of secret-named assignments (`HF_TOKEN=...`, or `"HF_TOKEN": "..."` in
    JSON a harness passed) replaced, so recording how a server was started leaks no credential."""
    return _ASSIGNMENT.sub(lambda m: f"{m['key']}{m['sep']}{REDACTED}" if is_secret(m["key"]) else m[0], text)


def filtered_env(environ: dict[str, str] | os._Environ | None = None) -> dict[str, str]:
    """The variables that can change a result, with secret values replaced by "<redacted>"."""
    environ = os.environ if environ is None else environ
    out = {}
    for key in sorted(environ):
        if key.startswith(_KEEP_PREFIXES) or key in _KEEP_NAMES:
            out[key] = REDACTED if is_secret(key) else environ[key]
    return out


def _run(argv: list[str], timeout: float = 10.0) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(path: Path) -> tuple[str | None, bool]:
    """(commit, dirty) of the git checkout containing `path`, or (None, False) when it is not one."""
    root = next((p for p in [path, *path.parents] if (p / ".git").exists()), None)
    if root is None or shutil.which("git") is None:
        return None, False
    commit = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    status = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return (commit.strip() if commit else None), bool(status and status.strip())


def versions() -> dict[str, str]:
    """Python, torch (+CUDA, NCCL), inference libraries, eyas version and commit; absent ones are left out."""
    import eyas

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("transformers", "tokenizers", "safetensors", "triton", "flashinfer-python", "sglang", "vllm"):
        out[dist] = _dist_version(dist)
    try:
        import torch  # lazy: a second of import time that `eyas runs list` must not pay

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        if torch.version.cuda:
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # a broken torch install is a fact to record, not a reason to lose the run
        out.setdefault("torch", _dist_version("torch"))
    out["eyas"] = eyas.__version__
    commit, dirty = git_commit(Path(eyas.__file__).resolve().parent)
    if commit:
        out["eyas_commit"] = commit + ("-dirty" if dirty else "")
    return {k: v for k, v in out.items() if v}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def hardware() -> dict:
    """Host, CPU, memory and, when nvidia-smi exists, GPUs, driver and the `nvidia-smi topo -m` matrix."""
    out: dict = {"hostname": platform.node(), "kernel": platform.release(), "cpu_model": _cpu_model(),
                 "cpu_count": os.cpu_count(), "memory_gib": _memory_gib()}
    smi = shutil.which("nvidia-smi")
    if smi:
        fields = ["index", "name", "memory.total", "driver_version", "pci.bus_id"]
        text = _run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
        rows = [[c.strip() for c in line.split(",")] for line in (text or "").splitlines() if line.strip()]
        gpus = [dict(zip(fields, row, strict=False)) for row in rows]
        out["gpus"] = gpus
        out["gpu_count"] = len(gpus)
        out["gpu_names"] = ", ".join(sorted({g.get("name", "?") for g in gpus}))
        out["driver"] = ", ".join(sorted({g.get("driver_version", "?") for g in gpus}))
        out["gpu_topology"] = _run([smi, "topo", "-m"])
    return {k: v for k, v in out.items() if v not in (None, "", [])}


def path_fingerprint(path: str | Path, cache_dir: Path | None = None) -> str:
    """A sha256 naming the contents of a model or draft directory (or one file); hidden files are ignored.

    One implementation, hostprobe.fingerprint, also runs on a serving host over ssh: the same weights give the
    same fingerprint here and there.
    """
    if not Path(path).exists():
        raise EyasError(f"cannot fingerprint {path}: no such file or directory")
    return hostprobe.fingerprint(path, cache_dir or eyas_home())
