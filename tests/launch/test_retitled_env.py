"""Processes that retitle themselves (setproctitle, as SGLang's scheduler/detokenizer and vLLM's EngineCore and
workers do) overwrite the memory /proc/PID/environ reads. Their environment must be read correctly when eyas
launches them (SPT_NOENV, and the interpreter-start snapshot), reported as unreadable (never as unset) when it
cannot be, and a launch must fail when the process answering on its port is not one it started."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.launch import procprobe
from eyas.ledger.ledger import Ledger
from eyas.launch.procenv import verify_env
from tests.launch.conftest import run_id_of, write_config

pytest.importorskip("setproctitle")
TREE = Path(__file__).with_name("retitled_tree.py")
NCCL = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL", "NCCL_BUFFSIZE": "16777216"}


def _wait_health(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the tree exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("no /health")


def _start_by_hand(port: int, env: dict, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in {**os.environ, **env}.items() if k != "SPT_NOENV"}
    return subprocess.Popen([sys.executable, str(TREE), str(port), *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_retitled_process_reads_from_memory_or_as_unreadable_never_as_unset(monkeypatch):
    port = free_port()
    proc = _start_by_hand(port, NCCL)
    try:
        _wait_health(port, proc)
        procs = procprobe.describe(procprobe.session(proc.pid))
        retitled = [p for p in procs if "sglang::" in p["cmdline"]]
        assert len(retitled) == 3  # two schedulers and the detokenizer
        # /proc shows the title and zeros; the environment the library moved is read from the process's memory
        assert all("overwritten" in p["proc_environ"] and p["env_source"] == "memory" for p in retitled)
        assert all(p["env"]["NCCL_ALGO"] == "Ring" and "SPT_NOENV" not in p["env"] for p in retitled)
        # where the memory cannot be read either, the process is unreadable, with both reasons
        monkeypatch.setattr(procprobe, "memory_environ", lambda pid: (None, "Permission denied"))
        blind = [p for p in procprobe.describe(procprobe.session(proc.pid)) if "sglang::" in p["cmdline"]]
        assert all("overwritten" in p["error"] and "Permission denied" in p["error"] and "env" not in p
                   for p in blind)
        launcher = next(p for p in procs if p["pid"] == proc.pid)
        assert launcher["env_source"] == "proc" and launcher["env"]["NCCL_ALGO"] == "Ring"
        report = verify_env(proc.pid, NCCL)
        assert not report.ok
        rows = [ln for ln in report.render().splitlines() if any(str(p["pid"]) in ln for p in retitled)]
        assert len(rows) == 3 and all("unreadable" in ln and "(unset)" not in ln for ln in rows)
        owner = procprobe.port_owner(port)
        assert owner["root"] == proc.pid and {p["pid"] for p in owner["processes"]} >= {p["pid"] for p in retitled}
    finally:
        _stop(proc)


@pytest.mark.parametrize("drop", [False, True], ids=["spt-noenv", "snapshot-only"])
def test_launch_verifies_every_retitled_process(tmp_path, capsys, drop):
    port = free_port()
    assigns = " ".join(f"{k}={v}" for k, v in NCCL.items())
    line = f"{assigns} {sys.executable} {TREE} {port}" + (" --drop-spt-noenv" if drop else "")
    config = write_config(tmp_path / "tree.toml", backend="sglang", model="tree", port=port, env=NCCL, shell_line=line,
                        startup_timeout_s=60.0, stop_timeout_s=5.0)
    code = main(["launch", config])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    with Ledger() as ledger:
        run = ledger.get(run_id_of(out))
    assert run.status == "ok" and run.results["env_verified"]
    # bash, the launcher, its resource tracker, two schedulers, the detokenizer: every one read and verified
    assert run.results["processes"] == len(run.workers) >= 5
    assert all(w.env[k] == v for w in run.workers for k, v in NCCL.items())
    retitled = [w for w in run.workers if "sglang::" in w.info["cmdline"]]
    assert len(retitled) == 3 and all(w.info["env_source"] == "snapshot" for w in retitled)
    assert all("--multiprocessing-fork" in w.info["argv"] for w in retitled)  # its argv before the retitle
    assert all(("overwritten" in w.info.get("proc_environ", "")) == drop for w in retitled)
    # the hook's own variables are not part of what was recorded
    assert not any("EYAS_ENV_SNAPSHOT_DIR" in w.env or "envhook" in w.env.get("PYTHONPATH", "")
                   for w in run.workers)


def test_a_launch_fails_when_another_server_answers_on_its_port(tmp_path, capsys, home):
    port = free_port()
    # The launched line never listens; a server started by hand takes the port once the launch has started it
    # (past the check that the port is free), as one still loading there would.
    config = write_config(tmp_path / "idle.toml", backend="sglang", model="idle", port=port,
                        shell_line=f"{sys.executable} -c 'import time; time.sleep(60)'", startup_timeout_s=60.0,
                        stop_timeout_s=5.0)
    stranger = subprocess.Popen(
        ["bash", "-c", f"until ls {home}/launches/*/server.pid; do sleep 0.1; done; exec {sys.executable} {TREE} "
                f"{port} --tp 1"], start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code = main(["launch", config])
        out, err = capsys.readouterr()
    finally:
        _stop(stranger)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert f"port {port}" in line and f"pid {stranger.pid}" in line and "not by the launched server" in line
    with Ledger() as ledger:
        run = ledger.list()[0]
    assert run.status == "failed" and "not by the launched server" in run.results["error"]


def test_the_hook_snapshots_and_still_runs_the_sitecustomize_it_shadows(tmp_path):
    from eyas.launch import envhook

    class Here:
        via = "local"

    envhook.install(Here(), str(tmp_path))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    env, added = envhook.with_hook({**os.environ, "PYTHONPATH": str(theirs), "NCCL_ALGO": "Ring"}, str(tmp_path))
    code = "import os, json; print(json.dumps([os.getpid(), os.environ.get('THEIRS_RAN')]))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    pid, theirs_ran = json.loads(done.stdout)
    snap = json.loads((Path(envhook.folders(str(tmp_path))[1]) / f"{pid}.json").read_text())
    assert theirs_ran == "1" and snap["env"]["NCCL_ALGO"] == "Ring" and snap["argv"] == ["-c"]
    assert envhook.strip(snap["env"], added)["PYTHONPATH"] == str(theirs)  # the user's entry stays
    assert "SPT_NOENV" not in envhook.strip(snap["env"], added) and snap["env"]["SPT_NOENV"] == "1"
