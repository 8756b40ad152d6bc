import json
import os
import signal
import subprocess
import sys

from eyas.launch.procenv import process_tree, read_environ, verify_env

# The launcher pattern from the lost 94 tok/s: a parent with NCCL tuning that starts workers two ways.
PARENT = r"""
import json, multiprocessing as mp, os, subprocess, sys, time

def worker():
    time.sleep(60)

if __name__ == "__main__":
    env = dict(os.environ)
    del env["NCCL_PROTO"]
    env["NCCL_ALGO"] = "Tree"
    sub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    # os.environ edits do not show in this process's /proc/PID/environ, but a spawned child starts with them.
    del os.environ["NCCL_BUFFSIZE"]
    ctx = mp.get_context("spawn")
    spawned = ctx.Process(target=worker)
    spawned.start()
    print(json.dumps({"sub": sub.pid, "spawned": spawned.pid}), flush=True)
    time.sleep(60)
"""


def test_verify_env_names_the_worker_and_key_that_differ(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "16777216"}
    parent = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        pids = json.loads(parent.stdout.readline())
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and {pids["sub"], pids["spawned"]} <= set(tree)
        required = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "16777216"}
        report = verify_env(parent.pid, required)
        by_pid = {p.pid: p for p in report.processes}
        assert by_pid[parent.pid].ok  # the parent's starting environment is still intact
        bad = {(p.pid, c.key, c.observed) for p, c in report.mismatches()}
        assert (pids["sub"], "NCCL_PROTO", None) in bad and (pids["sub"], "NCCL_ALGO", "Tree") in bad
        assert (pids["sub"], "NCCL_BUFFSIZE", "16777216") not in bad
        assert (pids["spawned"], "NCCL_BUFFSIZE", None) in bad
        assert {c.key for c in by_pid[pids["spawned"]].checks if not c.ok} == {"NCCL_BUFFSIZE"}
        assert by_pid[pids["sub"]].observed["NCCL_ALGO"] == "Tree" and "sleep" in by_pid[pids["sub"]].cmdline
        assert not report.ok
        text = report.render()
        assert "MISMATCH" in text and str(pids["sub"]) in text and "(unset)" in text
        assert read_environ(pids["sub"])["NCCL_ALGO"] == "Tree"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()


def test_verify_env_of_a_process_that_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    report = verify_env(proc.pid, {"NCCL_PROTO": "LL"})
    assert not report.ok and report.processes[0].error and "unreadable" in report.render()


def test_verify_env_of_a_matching_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={**os.environ, "EYAS_X": "1"})
    try:
        report = verify_env(proc.pid, {"EYAS_X": "1"})
        assert report.ok and [p.pid for p in report.processes] == [proc.pid]
        assert report.processes[0].observed["EYAS_X"] == "1"
        assert "all processes" in report.render()
    finally:
        proc.kill()
        proc.wait()
