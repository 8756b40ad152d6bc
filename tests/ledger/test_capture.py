import os
import subprocess
import sys

from eyas.ledger.capture import begin_run, record_workers
from eyas.launch.environment import REDACTED


def test_begin_run_captures_environment_versions_hardware_and_weights(ledger, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    environ = {"NCCL_PROTO": "LL", "HF_TOKEN": "hf_secret", "HOME": "/root"}
    run_id = begin_run(ledger, "serve", ["eyas", "serve", "--model", str(model)], {"spec_steps": 2},
                       model=str(model), draft="org/some-draft-on-the-hub", environ=environ)
    run = ledger.get(run_id)
    assert run.env == {"NCCL_PROTO": "LL", "HF_TOKEN": REDACTED} and run.cwd == os.getcwd()
    assert run.versions["python"] and run.hardware["cpu_count"] == os.cpu_count()
    assert len(run.model_fingerprint) == 64 and run.draft_fingerprint is None  # a hub id is not on disk
    # a redacted secret is left out of the command that reproduces the run; the rest is in it
    assert "HF_TOKEN" not in run.command() and "NCCL_PROTO=LL" in run.command() and run.status == "running"


def test_record_workers_reads_what_children_really_got(ledger):
    run_id = ledger.start_run("serve", ["eyas", "serve"], "/", {"NCCL_PROTO": "LL"}, {})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={**os.environ, "NCCL_PROTO": "Simple", "EYAS_WORKER": "1"})
    try:
        assert record_workers(ledger, run_id, os.getpid()) >= 1
    finally:
        child.kill()
        child.wait()
    workers = {w.info["pid"]: w for w in ledger.get(run_id).workers}
    assert workers[child.pid].env["NCCL_PROTO"] == "Simple" and workers[child.pid].env["EYAS_WORKER"] == "1"
    assert workers[child.pid].worker == f"pid{child.pid}" and "sleep" in workers[child.pid].info["cmdline"]
    assert os.getpid() not in workers  # the launcher itself is the run, not a worker
