"""Workers get an explicit environment from exec on, report what they observe, and a missing --env fails start-up."""

import os
import subprocess
import sys

import pytest

from eyas.dist import env_report
from eyas.dist.env_report import EnvReport
from eyas.dist.launch import WorkerGroup, free_port
from eyas.dist.messages import AddRequest, Step
from eyas.dist.worker import WorkerConfig
from eyas.errors import EyasError
from eyas.layers.sampling import SamplingParams
from eyas.launch.procenv import read_environ
from eyas.server.config import parse_env_pairs


def report(rank, **requested):
    return EnvReport(rank=rank, pid=100 + rank, host="h", device="cpu", torch="t", nccl=None, requested=requested,
                     variables={"NCCL_DEBUG": "INFO"})


def test_mismatches_name_key_and_worker():
    reports = [report(0, NCCL_PROTO="LL", NCCL_ALGO="Ring"), report(1, NCCL_PROTO=None, NCCL_ALGO="Tree")]
    problems = env_report.mismatches(reports, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"})
    assert problems == ["--env NCCL_PROTO=LL: worker 1 (pid 101) has NCCL_PROTO unset",
                        "--env NCCL_ALGO=Ring: worker 1 (pid 101) has NCCL_ALGO 'Tree'"]
    assert env_report.mismatches(reports[:1], {"NCCL_PROTO": "LL"}) == []


def test_table_marks_requested_keys():
    text = env_report.table([report(0, NCCL_PROTO="LL"), report(1, NCCL_PROTO=None)], ["NCCL_PROTO"])
    row = next(line for line in text.splitlines() if line.startswith("NCCL_PROTO *"))
    assert row.split()[2:] == ["LL", "(unset)"]
    assert "NCCL_DEBUG" in text and "worker 1" in text.splitlines()[0]


def test_env_pairs_parse_and_refuse():
    assert parse_env_pairs(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    for bad in ("NOEQUALS", "=1", "1A=2", "A B=1"):
        with pytest.raises(EyasError):
            parse_env_pairs([bad])


def test_test_hook_only_hits_its_rank(monkeypatch):
    monkeypatch.setenv("EYAS_X", "1")
    monkeypatch.setenv(env_report.TEST_HOOK, "EYAS_X:1")
    env_report.apply_test_hook(0)
    assert os.environ["EYAS_X"] == "1"
    env_report.apply_test_hook(1)
    assert "EYAS_X" not in os.environ


def test_workers_get_env_from_exec_and_warn_mode_reports_a_dropped_key(tiny_model, monkeypatch):
    monkeypatch.setenv(env_report.TEST_HOOK, "NCCL_ALGO:1")
    before = dict(os.environ)
    warnings = []
    group = WorkerGroup(WorkerConfig(model=str(tiny_model), device="cpu", max_model_len=128), tp=2,
                        env={"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, env_check="warn", log=warnings.append)
    try:
        info = group.start()
        assert dict(os.environ) == before  # the parent's environment was only borrowed for the spawn
        assert [r.requested["NCCL_PROTO"] for r in group.reports] == ["LL", "LL"]
        assert [r.requested["NCCL_ALGO"] for r in group.reports] == ["Ring", None]
        assert group.env_problems == ["--env NCCL_ALGO=Ring: worker 1 (pid %d) has NCCL_ALGO unset" % group.pids[1]]
        assert warnings == ["eyas: warning: " + group.env_problems[0]]
        for rank, pid in enumerate(group.pids):
            # Set before exec, so the kernel's record of the start-up environment has it (what procenv reads).
            env = read_environ(pid)
            assert env["NCCL_PROTO"] == "LL" and env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert info.max_len == 128 and not info.speculative
        # The lockstep protocol by hand: both ranks get the same commands; rank 0 answers.
        group.broadcast(AddRequest("r1", [5, 6, 7], SamplingParams(max_tokens=3)))
        tokens, finish = [], None
        while finish is None:
            group.broadcast(Step())
            [update] = group.receive().updates
            tokens, finish = tokens + update.new_ids, update.finish_reason
        assert len(tokens) == 3 and finish == "length" and update.verify_passes == 2
    finally:
        group.stop()
    assert all(not p.is_alive() for p in group.procs)


def test_dropped_env_key_fails_serve_startup_naming_key_and_worker(tiny_model):
    cmd = [sys.executable, "-m", "eyas.cli", "serve", "--model", str(tiny_model), "--device", "cpu", "--tp", "2",
           "--port", str(free_port()), "--env", "NCCL_PROTO=LL", "--env", "EYAS_OTHER=1"]
    env = {**os.environ, env_report.TEST_HOOK: "NCCL_PROTO:1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("eyas: error:")]
    assert len(errors) == 1
    assert "NCCL_PROTO" in errors[0] and "worker 1" in errors[0] and "unset" in errors[0]
    assert "Uvicorn running" not in r.stderr
