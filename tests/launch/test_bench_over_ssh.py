"""`eyas bench URL --host USER@HOST`: the process tree behind the port is read on the host over ssh (a real sshd
on 127.0.0.1), retitled processes included, and recorded as the bench run's workers."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eyas.dist.launch import free_port
from eyas.launch.remote import SshHost
from eyas.launch.server_identity import identify
from tests.remote.conftest import sshd  # noqa: F401  (fixture)

pytest.importorskip("setproctitle")
TREE = Path(__file__).with_name("retitled_tree.py")


def test_the_port_is_read_over_ssh(sshd):  # noqa: F811
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SPT_NOENV"}
    proc = subprocess.Popen(["bash", "-c", f"NCCL_ALGO=Ring; NCCL_PROTO=LL exec {sys.executable} {TREE} {port}"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        options = sshd.options()[1::2]  # the values of each --ssh-option
        facts = identify(f"http://127.0.0.1:{port}", host=SshHost("root@127.0.0.1", options))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    listener = facts.config["listener"]
    assert listener["root"] == proc.pid and listener["host"] == "127.0.0.1" and facts.host == "127.0.0.1"
    assert facts.config["backend"] == "sglang" and facts.config["server_args"]["tp_size"] == 2
    titles = [p["cmdline"] for p in facts.processes]
    assert sum(t.startswith("sglang::") for t in titles) == 3 and len(facts.processes) == listener["processes"]
    # the semicolon kept NCCL_ALGO from every process; NCCL_PROTO reached all of them, retitled ones included
    assert all("NCCL_ALGO" not in p["env"] and p["env"]["NCCL_PROTO"] == "LL" for p in facts.processes)
