"""train_arms: arm parsing, spreading jobs over devices, resuming and the report (the stages themselves are the
pipeline's, tested in tests/train)."""

import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_arms.py"


@pytest.fixture(scope="module")
def arms():
    spec = importlib.util.spec_from_file_location("train_arms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_arms"] = module
    spec.loader.exec_module(module)
    return module


def test_parse_arm(arms):
    assert arms.parse_arm("t05:train.teacher_temperature=0.5") == ("t05", ["train.teacher_temperature=0.5"])
    assert arms.parse_arm("two:train.lr=6e-4:train.weight_decay=0.1") == (
        "two", ["train.lr=6e-4", "train.weight_decay=0.1"])
    assert arms.parse_arm("again:") == ("again", [])
    for bad in ("a b:train.lr=1", "logs:train.lr=1", "x:lr=1", "x:train.lr", "baseline:"):
        with pytest.raises(arms.ArmError):
            arms.parse_arm(bad)


def test_children_see_one_gpu_and_import_eyas_from_the_checkout(arms, monkeypatch):
    src = str(SCRIPT.parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", f"/elsewhere:{src}")
    device, env = arms.on_device("cuda:1", sharing=2)
    assert device == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["PYTHONPATH"] == f"{src}:/elsewhere"  # first, once
    monkeypatch.delenv("PYTHONPATH")
    assert arms.on_device("cpu")[1]["PYTHONPATH"] == src


def test_jobs_spread_over_devices_one_at_a_time_per_device(arms):
    seen, running, lock = [], {}, threading.Lock()

    def job(i):
        def run(device):
            with lock:
                assert running.get(device, 0) == 0  # one job at a time on a device
                running[device] = 1
            seen.append((i, device))
            with lock:
                running[device] = 0
        return run

    arms.on_devices([job(i) for i in range(5)], ["cuda:0", "cuda:1"])
    assert sorted(seen) == [(0, "cuda:0"), (1, "cuda:1"), (2, "cuda:0"), (3, "cuda:1"), (4, "cuda:0")]


def test_a_device_listed_twice_runs_two_jobs_at_once(arms):
    """cuda:0,cuda:0: every job runs, and the two queues overlap in time (each waits for the other to start)."""
    both = threading.Barrier(2, timeout=10)
    seen = []

    def job(i):
        def run(device):
            if i < 2:
                both.wait()  # breaks (and fails the test) unless jobs 0 and 1 run at the same time
            seen.append((i, device))
        return run

    arms.on_devices([job(i) for i in range(4)], ["cuda:0", "cuda:0"])
    assert sorted(seen) == [(i, "cuda:0") for i in range(4)]


def test_a_failed_job_stops_its_device_and_is_raised(arms):
    done = []

    def ok(i):
        return lambda device: done.append(i)

    def fail(device):
        raise arms.ArmError("fit b failed (exit 1): boom")

    with pytest.raises(arms.ArmError, match="fit b failed"):
        arms.on_devices([ok(0), fail, ok(2), ok(3)], ["cuda:0", "cuda:1"])
    assert sorted(done) == [0, 2]  # cuda:1 stopped at its failure; cuda:0 went on


def test_seed_arm_copies_the_data_run_once(arms, tmp_path):
    run = tmp_path / "data-run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "regen-r0.jsonl").write_text("{}\n")
    (run / "vocab.safetensors").write_bytes(b"v")
    (run / "checkpoints").mkdir()  # not shared
    arms.seed_arm(run, tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".seeded", "data", "vocab.safetensors"]
    (tmp_path / "a" / "vocab.safetensors").write_bytes(b"kept")
    arms.seed_arm(run, tmp_path / "a")  # seeded already: nothing is copied over the arm's files
    assert (tmp_path / "a" / "vocab.safetensors").read_bytes() == b"kept"


def test_report_reads_what_the_runs_wrote(arms, tmp_path, capsys):
    def accept(chain, tree):
        return {"accept": {"mt-bench": {"chain": {"accept_length": chain}, "tree": {"accept_length": tree}}}}

    (tmp_path / "accept-baseline.json").write_text(json.dumps(accept(2.3114, 2.9251)))
    (tmp_path / "accept-t05.json").write_text(json.dumps(accept(2.4, 3.0)))
    (tmp_path / "t05").mkdir()
    (tmp_path / "t05" / "metrics.jsonl").write_text(
        '{"step": 0, "accept_length": 1.0}\n{"step": 20, "loss": 3.0}\n{"step": 40, "accept_length": 2.5}\n')
    (tmp_path / "times.json").write_text(json.dumps({"fit t05": 660.0}))
    rows = arms.report(tmp_path, [("t05", ["train.teacher_temperature=0.5"])], "/x/asset")
    assert rows[0] == {"arm": "baseline", "settings": "draft /x/asset", "held_out": None, "fit_s": None,
                       "mt-bench chain": 2.311, "mt-bench tree": 2.925}
    assert rows[1]["held_out"] == 2.5 and rows[1]["fit_s"] == 660.0 and rows[1]["mt-bench chain"] == 2.4
    assert json.loads((tmp_path / "arms.json").read_text())["rows"] == rows
    assert "| t05 | train.teacher_temperature=0.5 | 2.5 | 660.0 | 2.4 | 3.0 |" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(arms, tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('target = "demo"\n')
    for argv in (["--config", str(recipe), "--out", str(tmp_path)],
                 ["--config", str(tmp_path / "none.toml"), "--out", str(tmp_path), "--arm", "a:"],
                 ["--config", str(recipe), "--out", str(tmp_path), "--arm", "a:", "--arm", "a:train.lr=1"],
                 ["--config", str(recipe), "--out", str(tmp_path), "--arm", "a:", "--baseline", str(tmp_path)]):
        assert arms.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("train_arms: error: ") and err.count("\n") == 1, err


def test_a_directory_made_with_other_settings_is_not_reused(arms, tmp_path):
    arms.check_settings(tmp_path / "a", {"config": "x", "set": ["train.lr=1"]})
    arms.check_settings(tmp_path / "a", {"config": "x", "set": ["train.lr=1"]})  # the same: fine
    with pytest.raises(arms.ArmError, match="made with other settings"):
        arms.check_settings(tmp_path / "a", {"config": "x", "set": ["train.lr=2"]})


def test_each_child_sees_only_its_gpu(arms, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    device, env = arms.on_device("cuda:1")
    assert device == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "1"
    device, env = arms.on_device("cpu")
    assert device == "cpu" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_children_share_the_cores(arms, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(arms.os, "cpu_count", lambda: 32)
    assert arms.on_device("cuda:0", 2)[1]["OMP_NUM_THREADS"] == "16"
    assert arms.on_device("cuda:0", 64)[1]["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting stands
    assert arms.on_device("cuda:0", 2)[1]["OMP_NUM_THREADS"] == "3"
