import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.errors import EyasError
from eyas.launch import environment, hostprobe
from eyas.launch.environment import REDACTED, filtered_env, git_commit, hardware, path_fingerprint, versions


def test_filtered_env_keeps_what_matters_and_redacts_secrets():
    environ = {"NCCL_PROTO": "LL", "CUDA_VISIBLE_DEVICES": "0,1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "EYAS_HOME": "/e", "OMP_NUM_THREADS": "4",
               "MKL_NUM_THREADS": "4", "HF_HOME": "/hf", "TRANSFORMERS_OFFLINE": "1", "SGLANG_X": "1",
               "VLLM_Y": "2", "NVIDIA_VISIBLE_DEVICES": "all", "LD_LIBRARY_PATH": "/usr/lib",
               "PYTHONPATH": "/src", "TOKENIZERS_PARALLELISM": "false",
               "HF_TOKEN": "hf_abc", "EYAS_API_KEY": "k", "NCCL_IB_PKEY": "1", "SGLANG_SECRET": "s",
               "EYAS_DB_PASSWORD": "p", "HF_CREDENTIALS": "c", "EYAS_APIKEY": "k",
               "HOME": "/root", "USER": "me", "AWS_SECRET_ACCESS_KEY": "x", "TERM": "xterm", "PATH": "/bin"}
    out = filtered_env(environ)
    assert set(out) == {k for k in environ if k not in ("HOME", "USER", "AWS_SECRET_ACCESS_KEY", "TERM", "PATH")}
    secrets = {"HF_TOKEN", "EYAS_API_KEY", "NCCL_IB_PKEY", "SGLANG_SECRET", "EYAS_DB_PASSWORD", "HF_CREDENTIALS",
               "EYAS_APIKEY"}
    assert {k for k, v in out.items() if v == REDACTED} == secrets
    assert out["TOKENIZERS_PARALLELISM"] == "false" and out["NCCL_PROTO"] == "LL"
    assert list(out) == sorted(out)


def test_command_lines_lose_secret_values_only():
    from eyas.launch.environment import redact_command

    line = 'bash -c HF_TOKEN=hf_x NCCL_ALGO=Ring python h.py {"EYAS_API_KEY": "k1", "TOKENIZERS_PARALLELISM": "false"}'
    assert redact_command(line) == ('bash -c HF_TOKEN=<redacted> NCCL_ALGO=Ring python h.py '
                                    '{"EYAS_API_KEY": "<redacted>", "TOKENIZERS_PARALLELISM": "false"}')


def test_filtered_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert filtered_env()["NCCL_ALGO"] == "Ring"


def test_versions_never_crash(monkeypatch):
    v = versions()
    assert v["python"].count(".") == 2 and v["eyas"]
    assert "torch" in v  # installed in this environment
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    monkeypatch.setattr(environment, "git_commit", lambda path: (None, False))
    v = versions()
    assert "python" in v and "eyas_commit" not in v


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_of_a_checkout(tmp_path):
    assert git_commit(tmp_path) == (None, False)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("1")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    commit, dirty = git_commit(tmp_path / "sub" / "dir")
    assert len(commit) == 40 and not dirty
    (tmp_path / "f").write_text("2")
    assert git_commit(tmp_path) == (commit, True)


def test_hardware_without_and_with_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    hw = hardware()
    assert hw["cpu_count"] == os.cpu_count() and "gpus" not in hw and hw["hostname"]
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   'if [ "$1" = topo ]; then printf "\\tGPU0\\tGPU1\\nGPU0\\t X \\tNV18\\nGPU1\\tNV18\\t X \\n"; '
                   "exit 0; fi\n"
                   'echo "0, NVIDIA H200, 143771 MiB, 570.86.15, 00000000:19:00.0"\n'
                   'echo "1, NVIDIA H200, 143771 MiB, 570.86.15, 00000000:3B:00.0"\n')
    smi.chmod(0o755)
    hw = hardware()
    assert hw["gpu_count"] == 2 and hw["gpu_names"] == "NVIDIA H200" and hw["driver"] == "570.86.15"
    assert hw["gpus"][1] == {"index": "1", "name": "NVIDIA H200", "memory.total": "143771 MiB",
                             "driver_version": "570.86.15", "pci.bus_id": "00000000:3B:00.0"}
    assert "NV18" in hw["gpu_topology"]


def _checkpoint(root):
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "model.safetensors").write_bytes(b"\0" * 1000)
    (root / "train.log").write_text("step 1\n")
    (root / ".cache").mkdir()
    (root / ".cache" / "lock").write_text("x")
    return root


def test_path_fingerprint_tracks_contents_and_caches(tmp_path, monkeypatch):
    root = _checkpoint(tmp_path / "ckpt")
    calls = []
    real = hostprobe.hash_file  # the one implementation, also run on serving hosts over ssh
    monkeypatch.setattr(hostprobe, "hash_file", lambda p: calls.append(p.name) or real(p))
    first = path_fingerprint(root)
    assert len(first) == 64 and sorted(calls) == ["config.json", "model.safetensors"]
    assert (environment.eyas_home() / "fingerprints.db").exists()  # the cache sits next to the ledger
    calls.clear()
    assert path_fingerprint(root) == first and calls == []  # nothing re-read
    (root / ".cache" / "lock").write_text("changed")  # hidden files do not count
    assert path_fingerprint(root) == first
    (root / "model.safetensors").write_bytes(b"\1" + b"\0" * 999)  # same size, new bytes, new mtime
    second = path_fingerprint(root)
    assert second != first and calls == ["model.safetensors"]
    (root / "config.json").rename(root / "config2.json")  # names count too
    assert path_fingerprint(root) not in (first, second)
    copy = _checkpoint(tmp_path / "copy")  # same contents elsewhere: same fingerprint
    (copy / "model.safetensors").write_bytes(b"\1" + b"\0" * 999)
    (copy / "config.json").rename(copy / "config2.json")
    assert path_fingerprint(copy) == path_fingerprint(root)
    assert len(path_fingerprint(root / "config2.json")) == 64
    with pytest.raises(EyasError, match="no such"):
        path_fingerprint(tmp_path / "missing")


def test_host_probe_reads_a_host_whose_eyas_has_another_layout(tmp_path):
    """The probe is fed to the host's Python over ssh; an eyas installed there without eyas.launch (an older
    layout) is read the stdlib way, never a failed launch."""
    (tmp_path / "eyas").mkdir()
    (tmp_path / "eyas" / "__init__.py").write_text("__version__ = 'older'\n")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-", "probe", "-", "-"], input=Path(hostprobe.__file__).read_bytes(),
                          capture_output=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    facts = json.loads(done.stdout)
    assert facts["versions"]["python"] == platform.python_version()
    assert facts["hardware"]["cpu_count"] == os.cpu_count()
