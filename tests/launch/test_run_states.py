"""A launcher killed with -9 leaves no run "running" forever: the next ledger open closes it as abandoned (its
server still up), and `eyas remote stop` stops that server and records the run as stopped."""

import os
import signal
import subprocess
import sys
import time

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.launch import procprobe
from eyas.ledger.ledger import Ledger
from tests.launch.conftest import write_config


def _running_server_pid():
    try:
        with Ledger.existing() as ledger:
            runs = ledger.list()
    except Exception:  # not created yet
        return None
    return runs[0].results.get("server_pid") if runs and runs[0].status == "running" else None


def test_a_killed_launcher_leaves_an_abandoned_run_that_remote_stop_closes(tmp_path, capsys, home):
    # A server that never answers /health, so the launcher is still waiting for it when it is killed.
    config = write_config(tmp_path / "slow.toml", backend="sglang", model="slow", port=free_port(),
                        shell_line=f"{sys.executable} -c 'import time; time.sleep(120)'", startup_timeout_s=300.0,
                        stop_timeout_s=5.0)
    launcher = subprocess.Popen([sys.executable, "-m", "eyas.cli", "launch", config], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _running_server_pid():  # the launcher stores its server's pid in the run as it starts it
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    with Ledger() as ledger:
        [run] = ledger.list()
    assert run.status == "abandoned" and str(launcher.pid) in run.results["abandoned"]
    sid = run.results["server_pid"]
    assert run.results["server_still_running"] is True and procprobe.session(sid)

    assert main(["remote", "stop", run.run_id]) == 0
    out, _ = capsys.readouterr()
    assert "recorded as stopped" in out and not procprobe.session(sid)
    with Ledger() as ledger:
        run = ledger.get(run.run_id)
    assert run.status == "stopped" and run.results["stopped"].startswith("eyas remote stop")
    assert os.path.exists(run.results["log"])
