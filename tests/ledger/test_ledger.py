import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from eyas.errors import EyasError
from eyas.ledger.ledger import Ledger
from eyas.ledger.ledger_schema import LATEST, connect, migrate, schema_version


def _bench(ledger, steps, tok_s, env=None, status="ok", kind="bench"):
    run_id = ledger.start_run(kind, ["eyas", "bench", "--spec-steps", str(steps)], "/w", env or {},
                              {"spec_steps": steps, "spec": {"topk": 1}}, model="/m", draft="/d")
    if status != "running":
        ledger.finish_run(run_id, status, {"output_tok_s": tok_s})
    return run_id


def test_default_path_is_under_eyas_home(ledger, home):
    assert ledger.path == home / "runs.db"
    assert ledger.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert ledger.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30000


def test_start_finish_get_roundtrip(ledger):
    run_id = ledger.start_run("serve", ["eyas", "serve", "--model", "/m"], "/w", {"NCCL_PROTO": "LL"},
                              {"spec_steps": 2}, model="/m", draft="/d", versions={"torch": "2.13"},
                              hardware={"gpu_count": 8})
    assert run_id.split("-")[0] == "1" and len(run_id.split("-")) == 3
    assert ledger.get(run_id).status == "running"
    ledger.add_worker_env(run_id, "tp0", {"NCCL_PROTO": "LL"}, {"pid": 10})
    ledger.finish_run(run_id, "ok", {"output_tok_s": 94.0, "bad": float("nan")})
    run = ledger.get("1")  # the integer alone is enough
    assert (run.kind, run.status, run.model, run.draft) == ("serve", "ok", "/m", "/d")
    assert run.argv == ["eyas", "serve", "--model", "/m"] and run.cwd == "/w"
    assert run.env == {"NCCL_PROTO": "LL"} and run.config == {"spec_steps": 2}
    assert run.results == {"output_tok_s": 94.0, "bad": None}  # NaN is not JSON; stored as null
    assert run.versions == {"torch": "2.13"} and run.hardware == {"gpu_count": 8}
    assert [(w.worker, w.env, w.info) for w in run.workers] == [("tp0", {"NCCL_PROTO": "LL"}, {"pid": 10})]
    assert run.finished_at >= run.started_at


def test_run_ids_unique_and_stale_ids_rejected(ledger):
    ids = [_bench(ledger, 2, 90.0) for _ in range(3)]
    assert len(set(ids)) == 3
    number, date, clock = ids[0].split("-")
    with pytest.raises(EyasError, match="no run"):
        ledger.get(f"{number}-{date}-{(int(clock) + 1) % 240000:06d}")
    for bad in ("99", "x1", "1-2"):
        with pytest.raises(EyasError):
            ledger.get(bad)


def test_bad_kind_status_and_double_finish(ledger):
    with pytest.raises(EyasError, match="kind"):
        ledger.start_run("dance", [], "/", {}, {})
    run_id = _bench(ledger, 2, 1.0, status="running")
    with pytest.raises(EyasError, match="status"):
        ledger.finish_run(run_id, "great", {})
    ledger.finish_run(run_id, "ok", {"output_tok_s": 1.0})
    with pytest.raises(EyasError, match="already finished"):
        ledger.finish_run(run_id, "ok", {"output_tok_s": 999.0})
    assert ledger.get(run_id).results == {"output_tok_s": 1.0}


def ids(runs):
    return [r.run_id for r in runs]


def test_where_sort_limit_best(ledger):
    a = _bench(ledger, 2, 94.0, {"NCCL_PROTO": "LL"})
    b = _bench(ledger, 3, 61.7)
    c = _bench(ledger, 2, 88.0)
    d = _bench(ledger, 4, 200.0, status="failed")
    e = _bench(ledger, 2, None, status="running", kind="serve")
    ledger.add_worker_env(a, "tp0", {"NCCL_PROTO": "LL"}, {})
    assert ids(ledger.list()) == [e, d, c, b, a]
    assert ids(ledger.list(descending=False)) == [a, b, c, d, e]
    assert ids(ledger.list({"config.spec_steps": "2"})) == [e, c, a]  # "2" matches the JSON integer 2
    assert ids(ledger.list({"config.spec.topk": "1", "kind": "serve"})) == [e]
    assert ids(ledger.list({"env.NCCL_PROTO": "LL"})) == [a]
    assert ids(ledger.list({"workers.NCCL_PROTO": "LL"})) == [a]
    assert ids(ledger.list({"status": "ok"}, sort="output_tok_s")) == [a, c, b]
    assert ids(ledger.list(sort="output_tok_s", limit=2)) == [d, a]
    assert ids(ledger.list(sort="results.output_tok_s", descending=False))[:3] == [b, c, a]
    assert ids(ledger.list(sort="output_tok_s"))[-1] == e  # no value: last either way
    assert ledger.best("output_tok_s").run_id == a  # the failed 200 tok/s run does not count
    assert ledger.best("output_tok_s", {"status": "failed"}).run_id == d
    assert ledger.best("output_tok_s", higher_is_better=False).run_id == b
    assert ledger.best("output_tok_s", {"config.spec_steps": "3"}).run_id == b
    assert ledger.best("output_tok_s", {"config.spec_steps": "9"}) is None
    with pytest.raises(EyasError, match="unknown field"):
        ledger.list({"nonsense": "1"})
    with pytest.raises(EyasError, match="unknown field"):
        ledger.list(sort="argv.x")


def test_migrates_a_v1_ledger(tmp_path):
    path = tmp_path / "old.db"
    conn = connect(path)
    assert migrate(conn, target=1) == 1
    conn.execute("INSERT INTO runs (kind, status, started_at, finished_at, argv, cwd, env, config, model, results) "
                 "VALUES ('bench', 'ok', 1.7e9, 1.7e9, ?, '/w', ?, ?, '/m', ?)",
                 (json.dumps(["eyas", "bench"]), json.dumps({"NCCL_PROTO": "LL"}), json.dumps({"spec_steps": 2}),
                  json.dumps({"output_tok_s": 94.0})))
    conn.close()
    with Ledger(path) as ledger:
        assert schema_version(ledger.conn) == LATEST == 3
        old = ledger.get(1)
        assert (old.env, old.results, old.versions, old.hardware) == ({"NCCL_PROTO": "LL"}, {"output_tok_s": 94.0},
                                                                      {}, {})
        indexes = {r[0] for r in ledger.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"runs_kind_started", "worker_env_run"} <= indexes
        new = ledger.start_run("bench", [], "/", {}, {}, versions={"torch": "2.13"}, model_fingerprint="ab")
        assert ledger.get(new).versions == {"torch": "2.13"} and ledger.get(new).model_fingerprint == "ab"
        assert ledger.best("output_tok_s").run_id == old.run_id
    with Ledger(path) as again:  # reopening does not re-apply anything
        assert [r[0] for r in again.conn.execute("SELECT version FROM schema_version")] == [1, 2, 3]


def test_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "new.db"
    Ledger(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (99, 0, 'future')")
    conn.commit()
    conn.close()
    with pytest.raises(EyasError, match="newer"):
        Ledger(path)


def _writer(path, worker, n):
    with Ledger(path) as ledger:
        for i in range(n):
            run_id = ledger.start_run("tune", ["eyas", "tune"], "/", {"W": str(worker)}, {"i": i})
            ledger.add_worker_env(run_id, "tp0", {"W": str(worker)}, {})
            ledger.finish_run(run_id, "ok", {"worker": worker, "i": i})


def test_concurrent_writers_from_several_processes(tmp_path):
    path = tmp_path / "shared.db"  # created by whichever process gets there first: migration races too
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with Ledger(path) as ledger:
        runs = ledger.list()
        assert len(runs) == 100 and len({r.run_id for r in runs}) == 100
        assert {(r.results["worker"], r.results["i"]) for r in runs} == {(w, i) for w in range(4) for i in range(25)}
        assert all(r.status == "ok" and len(r.workers) == 1 for r in runs)
        assert [r[0] for r in ledger.conn.execute("SELECT version FROM schema_version")] == [1, 2, 3]


_KILL_ME = """
import sys
from eyas.ledger.ledger import Ledger
ledger = Ledger(sys.argv[1])
blob = "x" * 200_000  # big rows make the kill likely to land inside a transaction
while True:
    run_id = ledger.start_run("bench", ["eyas", "bench"], "/", {"NCCL_PROTO": "LL"}, {"blob": blob})
    ledger.add_worker_env(run_id, "tp0", {"blob": blob}, {})
    ledger.finish_run(run_id, "ok", {"output_tok_s": 1.0})
    print(run_id, flush=True)
"""


def test_sigkill_mid_write_keeps_every_completed_run(tmp_path):
    path = tmp_path / "killed.db"
    completed = []
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _KILL_ME, str(path)], stdout=subprocess.PIPE, text=True)
        for _ in range(10 + 7 * round_):
            completed.append(proc.stdout.readline().strip())
        time.sleep(0.003 * round_)  # vary where in the write cycle the kill lands
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        completed += [line.strip() for line in proc.stdout if line.strip()]  # printed before the kill
        proc.stdout.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    with Ledger(path) as ledger:
        runs = {r.run_id: r for r in ledger.list()}
        for run_id in completed:
            assert runs[run_id].status == "ok" and runs[run_id].results == {"output_tok_s": 1.0}
            assert len(runs[run_id].workers) == 1
        # at most one run per kill was caught between start_run and finish_run, and its launcher is gone
        assert sum(r.status == "abandoned" for r in runs.values()) <= 3
        assert not any(r.status == "running" for r in runs.values())
        assert ledger.start_run("bench", [], "/", {}, {})  # and the ledger still takes writes


_LAUNCH_THEN_DIE = """
import os, signal, subprocess, sys
from eyas.ledger.ledger import Ledger
ledger = Ledger(sys.argv[1])
server = subprocess.Popen(["sleep", "60"], start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
run_id = ledger.start_run("launch", ["vllm", "serve"], "/", {}, {"launch": {"via": "local"}})
ledger.note_running(run_id, {"server_pid": server.pid})
bench = ledger.start_run("bench", ["eyas", "bench"], "/", {}, {})
print(run_id, bench, server.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_runs_whose_launcher_died_become_abandoned(tmp_path):
    path = tmp_path / "runs.db"
    done = subprocess.run([sys.executable, "-c", _LAUNCH_THEN_DIE, str(path)], capture_output=True, text=True)
    launched, bench, server = done.stdout.split()
    try:
        with Ledger(path) as ledger:
            mine = ledger.start_run("bench", [], "/", {}, {})  # this process is alive: its run stays running
        with Ledger(path) as ledger:
            run, b = ledger.get(launched), ledger.get(bench)
            assert ledger.get(mine).status == "running"
        assert run.status == b.status == "abandoned" and run.finished_at
        assert "launcher" in run.results["abandoned"] and run.results["server_pid"] == int(server)
        assert run.results["server_still_running"] is True and "server_still_running" not in b.results
        assert run.launcher["pid"] != os.getpid()
    finally:
        os.kill(int(server), signal.SIGKILL)
    with Ledger(path) as ledger:  # closed once: a later open changes nothing
        assert ledger.get(launched).results == run.results


def test_remote_stop_closes_an_open_run_and_notes_a_finished_one(ledger):
    open_run = ledger.start_run("launch", [], "/", {}, {})
    kept = ledger.start_run("launch", [], "/", {}, {})
    ledger.finish_run(kept, "ok", {"output_tok_s": 9.0, "stopped": "kept running"})
    assert ledger.record_stop(open_run, {"stopped": "eyas remote stop: stopped with SIGTERM"}) == "stopped"
    assert ledger.record_stop(kept, {"stopped": "eyas remote stop: stopped with SIGTERM"}) == "ok"
    assert ledger.get(open_run).status == "stopped" and ledger.get(open_run).finished_at
    assert ledger.get(kept).results == {"output_tok_s": 9.0, "stopped": "eyas remote stop: stopped with SIGTERM"}
    with pytest.raises(EyasError, match="already finished"):
        ledger.finish_run(open_run, "ok", {})
