"""`eyas launch --host` through a real sshd on 127.0.0.1: the environment arrives byte for byte in every server
process, the server outlives its ssh connection, a replay runs it again, and bad hosts fail in one line without a
successful record."""

import re
import subprocess
import sys

import httpx

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.ledger.ledger import Ledger
from tests.launch.conftest import run_id_of, write_config
from tests.remote.sshd import Sshd

# Spaces, both quotes, a `$`, a backslash and a newline: everything a shell could mangle on the way.
HOSTILE = "a b 'single' \"double\" $HOME \\ back\nsecond line"


def eyas(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def remote(sshd, tmp_path, *extra):
    return ["--host", "root@127.0.0.1", *sshd.options(), "--remote-dir", str(tmp_path / "remote"), *extra]


def test_remote_launch_verifies_env_outlives_its_ssh_connection_stops_and_replays(sshd, tmp_path, capsys, tiny,
                                                                                 prompts):
    """One kept-running launch serves the environment checks and the ssh-loss checks; its replay then runs (and
    stops) the usual way. (`sshd`: skipped where no sshd can run.)"""
    own = Sshd(tmp_path / "sshd").start()  # this test kills its sshd; the shared one stays up
    try:
        config = write_config(tmp_path / "r.toml", model=str(tiny), env={"NCCL_PROTO": "LL", "HOSTILE": HOSTILE},
                            bench={"dataset": str(prompts), "num_prompts": 2, "max_tokens": 8})
        code, out, err = eyas(capsys, "launch", config, *remote(own, tmp_path), "--keep-running")
        assert code == 0 and "eyas remote status|logs|stop" in out, err
        run_id = run_id_of(out)
        with Ledger() as ledger:
            run = ledger.get(run_id)
        assert run.host == "127.0.0.1" and run.status == "ok" and run.config["launch"]["target"] == "root@127.0.0.1"
        assert run.workers and all(w.env["HOSTILE"] == HOSTILE and w.env["NCCL_PROTO"] == "LL" for w in run.workers)
        assert all(w.info["host"] == "127.0.0.1" for w in run.workers)
        assert run.results["log"] == f"{tmp_path}/remote/{run_id}/server.log" and run.results["completed"] == 2
        assert (tmp_path / "remote" / run_id / "launch.sh").read_text().startswith("#!/bin/sh")
        assert run.versions["python"] and run.hardware["cpu_count"]
        url = f"http://127.0.0.1:{run.config['port']}/health"

        code, out, _ = eyas(capsys, "remote", "status", run_id)
        assert code == 0 and re.search(r"[1-9]\d* process\(es\)", out) and ": 200" in out
        code, out, _ = eyas(capsys, "remote", "logs", run_id, "-n", "50")
        assert code == 0 and "eyas: serving" in out

        own.stop()  # every ssh connection and the daemon itself die
        assert httpx.get(url, timeout=5).status_code == 200
        code, _, err = eyas(capsys, "remote", "status", run_id)
        assert code == 2 and "Connection refused" in err

        own.start()
        code, out, _ = eyas(capsys, "remote", "stop", run_id)
        assert code == 0 and "stopped with SIGTERM" in out
        try:
            httpx.get(url, timeout=2)
            raise AssertionError("the server still answers after eyas remote stop")
        except httpx.HTTPError:
            pass
        code, out, _ = eyas(capsys, "remote", "stop", run_id)
        assert code == 0 and "nothing was running" in out

        # The replay's mechanics, not this shared CPU's timing: a tiny model's latency can move several-fold
        # under load, so the threshold only fails a replay that did not run.
        code, out, err = eyas(capsys, "runs", "replay", run_id, "--threshold", "100000")
        assert code == 0 and "PASS" in out, out + err
        with Ledger() as ledger:
            again = ledger.list(descending=True, limit=1)[0]
        assert again.host == "127.0.0.1" and again.config["launch"]["replay_of"] == run_id
        assert all(w.env["HOSTILE"] == HOSTILE for w in again.workers)
        assert again.results["stopped"] == "terminated"  # without --keep-running the launch stops it over ssh
    finally:
        own.stop()


def _no_successful_run():
    with Ledger() as ledger:
        return not ledger.list({"status": "ok"})


def test_bad_hosts_fail_in_one_line_and_record_no_success(sshd, tmp_path, capsys, tiny, home):
    config = write_config(tmp_path / "b.toml", model=str(tiny))
    bare = tmp_path / "bare-venv"  # a Python that exists but has no eyas
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    cases = {
        "Connection refused": ["--host", "root@127.0.0.1", *sshd.options(port=free_port())],  # nothing listens
        "Permission denied": ["--host", "root@127.0.0.1", *sshd.options(key=sshd.other_key)],
        "no Python at /nonexistent/python3": [*remote(sshd, tmp_path), "--python", "/nonexistent/python3"],
        "cannot import eyas": [*remote(sshd, tmp_path), "--python", str(bare / "bin" / "python")],
    }
    for expected, args in cases.items():
        code, out, err = eyas(capsys, "launch", config, *args)
        assert code == 2, (expected, err)
        assert err.startswith("eyas: error: ") and err.count("\n") == 1 and expected in err, err
    assert not (home / "runs.db").exists() or _no_successful_run()
