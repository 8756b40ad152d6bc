import re

from eyas.ledger.diff import argv_options, diff_runs
from eyas.ledger.record import RunRecord, WorkerEnv

NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}


def run(run_id, *, env, workers, steps=2, torch="2.13.0", gpus="NVIDIA H200", tok_s=94.0, extra_env=None):
    return RunRecord(
        run_id=run_id, kind="serve", status="ok", started_at=1.7e9, finished_at=1.7e9 + 60,
        argv=["eyas", "serve", "--model", "/m", "--spec-steps", str(steps), "--trust-remote-code"], cwd="/w",
        env={**env, **(extra_env or {})}, config={"spec": {"num_steps": steps, "topk": 1}, "max_batch": 8},
        results={"output_tok_s": tok_s, "accept_len": 2.4, "label": "x"}, model="/m", draft="/d",
        versions={"torch": torch, "python": "3.11.7"}, hardware={"gpu_names": gpus, "gpu_count": 8},
        workers=[WorkerEnv(f"tp{i}", w, {}, 0.0) for i, w in enumerate(workers)])


def test_explain_puts_a_variable_missing_in_workers_first():
    good = run("1", env=NCCL, workers=[NCCL] * 8)
    # The regression: the launcher still asks for LL/Ring, the spawned workers never got them.
    bad = run("2", env=NCCL, workers=[{}] * 8, steps=3, torch="2.14.0", gpus="NVIDIA H100", tok_s=61.7,
              extra_env={"CUDA_LAUNCH_BLOCKING": "0", "NCCL_DEBUG": "INFO"})
    diff = diff_runs(good, bad)
    causes = diff.explain()
    assert [(c.section, c.key) for c in causes[:2]] == [("workers", "NCCL_ALGO"), ("workers", "NCCL_PROTO")]
    assert "missing in 8/8 workers of B" in causes[0].note
    assert (causes[0].a, causes[0].b) == ("Ring x8", "unset x8")
    sections = [c.section for c in causes]
    order = ["workers", "environment", "arguments", "config", "versions", "hardware"]
    assert sections == sorted(sections, key=lambda s: order.index(s if s != "config" else "arguments"))
    env_keys = [c.key for c in causes if c.section == "environment"]
    assert env_keys == ["NCCL_DEBUG", "CUDA_LAUNCH_BLOCKING"]  # NCCL first
    spec = [c.key for c in causes if c.section in ("arguments", "config")]
    assert set(spec) == {"--spec-steps", "spec.num_steps"}
    assert [(c.key, c.a, c.b) for c in causes if c.section == "versions"] == [("torch", "2.13.0", "2.14.0")]
    assert [c.key for c in causes][-1] == "gpu_names"
    results = {r.key: r for r in diff.sections["results"]}
    assert results["output_tok_s"].note == "-34.4%" and results["accept_len"].note == "+0.0%"
    assert results["label"].note == ""
    assert diff.identical["environment"] == 2 and diff.identical["arguments"] >= 3


def test_missing_in_workers_is_found_even_when_both_runs_agree():
    a = run("1", env=NCCL, workers=[NCCL, {}])
    b = run("2", env=NCCL, workers=[NCCL, {}], tok_s=90.0)
    causes = diff_runs(a, b).explain()
    assert [c.key for c in causes] == ["NCCL_ALGO", "NCCL_PROTO"]
    assert causes[0].a == causes[0].b == "Ring x1, unset x1"
    assert "missing in 1/2 workers of A" in causes[0].note and "of B" in causes[0].note


def test_same_runs_have_no_causes_and_runs_without_workers_compare():
    a = run("1", env=NCCL, workers=[])
    assert diff_runs(a, a).explain() == []
    b = run("2", env={}, workers=[])
    b.versions = {}
    causes = diff_runs(a, b).explain()
    assert [(c.section, c.key) for c in causes] == [("environment", "NCCL_ALGO"), ("environment", "NCCL_PROTO"),
                                                    ("versions", "(all)")]
    assert causes[-1].b == "not recorded"
    assert "no differences besides results" in diff_runs(a, a).render()


def test_render_is_an_aligned_table():
    text = diff_runs(run("1", env=NCCL, workers=[NCCL]), run("2", env={}, workers=[{}], tok_s=50.0)).render()
    assert text.splitlines()[0].startswith("A = 1 (serve, ok,")
    block = text.split("\nresults\n")[1].split("\n\n")[0].splitlines()
    header, rule, *rows = block
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    assert [m.start() for m in re.finditer(r"-+", rule)] == starts
    row = next(r for r in rows if r.startswith("output_tok_s"))
    assert [row[s:].split()[0] for s in starts] == ["output_tok_s", "94.0", "50.0", "-46.8%"]
    assert "1. [workers] NCCL_ALGO" in text


def test_argv_options():
    assert argv_options(["eyas", "serve", "--tp", "8", "--x=1", "--flag", "--lr", "-0.5", "-v", "file.py"]) == {
        "--tp": "8", "--x": "1", "--flag": "true", "--lr": "-0.5", "-v": "file.py", "(args)": "serve"}


def record(run_id, *, kind="launch", status="ok", argv=None, env=None, workers=(), results=None, config=None,
           draft="/d", draft_fp="f" * 64, started=1.7e9):
    return RunRecord(run_id=run_id, kind=kind, status=status, started_at=started, finished_at=started + 60,
                     argv=argv or ["python", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--tensor-parallel-size",
                                   "3"],
                     cwd="/w", env=dict(env or {}), config=dict(config or {"tp": 3}),
                     results=dict({"startup_s": 5.0, "output_tok_s": 94.0} if results is None else results),
                     model="/m", draft=draft, draft_fingerprint=draft_fp,
                     workers=[WorkerEnv(f"pid{i}", dict(w), {"cmdline": "vllm serve /m"}, 0.0)
                              for i, w in enumerate(workers)])


def test_render_puts_the_ranked_causes_before_the_results_table():
    text = diff_runs(run("1", env=NCCL, workers=[NCCL]), run("2", env=NCCL, workers=[{}], tok_s=50.0)).render()
    assert text.index("most plausible explanations") < text.index("\nresults\n") < text.index("\nworkers")
    assert text.splitlines()[3].startswith("1. [workers] NCCL_ALGO")


def test_a_server_that_never_started_is_the_cause_not_its_missing_variables():
    good = record("1", env=NCCL, workers=[NCCL] * 3)
    dead = record("2", status="failed", env=NCCL, results={"error": "the server exited before /health answered"})
    causes = diff_runs(good, dead).explain()
    assert (causes[0].section, causes[0].key, causes[0].b) == ("run", "server", "never started")
    assert "exited before /health" in causes[0].note
    assert not [c for c in causes if c.section == "workers"]


def test_env_missing_in_hand_started_workers_is_the_first_cause():
    """`NCCL_ALGO=Ring; vllm serve ...` then `eyas bench`: the workers never got it; a launch's workers did."""
    launched = record("1", env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"},
                      workers=[{"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL", "VLLM_CPU_KVCACHE_SPACE": "1"}] * 4)
    by_hand = record("2", kind="bench", env={"NCCL_PROTO": "LL", "OMP_NUM_THREADS": "2"},
                     workers=[{"NCCL_PROTO": "LL", "VLLM_CPU_KVCACHE_SPACE": "2"}] * 4,
                     results={"output_tok_s": 61.7}, config={"dataset": "mt-bench", "num_prompts": 8})
    diff = diff_runs(launched, by_hand)
    first = diff.explain()[0]
    assert (first.section, first.key, first.a, first.b) == ("workers", "NCCL_ALGO", "Ring x4", "unset x4")
    assert "missing in every worker of B" in first.note
    assert diff.render().splitlines()[3].startswith("1. [workers] NCCL_ALGO: Ring x4 -> unset x4")


def test_a_bash_c_line_is_compared_as_the_command_it_runs():
    line = record("1", argv=["bash", "-c", "NCCL_ALGO=Ring python -m sglang.launch_server --model-path /m --tp 2"])
    built = record("2", argv=["python", "-m", "sglang.launch_server", "--model-path", "/m", "--tp", "4"])
    rows = {r.key: r for r in diff_runs(line, built).sections["arguments"]}
    assert set(rows) == {"--tp", "(started by)"} and (rows["--tp"].a, rows["--tp"].b) == ("2", "4")
    assert (rows["(started by)"].a, rows["(started by)"].b) == ("bash -c line", "command")


def test_weights_same_fingerprint_new_path_and_retrained_at_the_same_path():
    copy = diff_runs(record("1", draft="/a/draft"), record("2", draft="/b/draft"))
    [row] = copy.sections["weights"]
    assert row.note.startswith("same weights") and row not in copy.explain()
    retrained = diff_runs(record("1"), record("2", draft_fp="e" * 64))
    [row] = [c for c in retrained.explain() if c.section == "weights"]
    assert row.key == "draft contents" and "same path, different contents" in row.note


def test_a_change_within_the_measured_run_to_run_spread_is_noise():
    repeats = [record(str(i), results={"startup_s": 5.0, "output_tok_s": v}) for i, v in ((1, 94.0), (2, 90.0),
                                                                                           (3, 96.0))]
    notes = {r.key: r.note for r in diff_runs(repeats[0], repeats[1], history=repeats).sections["results"]}
    assert notes["output_tok_s"].startswith("-4.3% noise: within the 6.4% run-to-run spread of 2 runs")
    lost = record("4", env={"NCCL_ALGO": "Ring"}, workers=[{}] * 3, results={"startup_s": 5.0, "output_tok_s": 61.7})
    notes = {r.key: r.note for r in diff_runs(repeats[0], lost, history=repeats + [lost]).sections["results"]}
    assert "beyond the 6.4% run-to-run spread of 3 runs" in notes["output_tok_s"]
    alone = {r.key: r.note for r in diff_runs(repeats[0], lost).sections["results"]}
    assert alone["output_tok_s"] == "-34.4%"  # no repeats recorded: no claim either way


def test_login_environment_and_what_the_server_got_both_show():
    login = {"NCCL_SOCKET_IFNAME": "lo", "PATH": "/usr/bin"}
    inherited = record("1", config={"launch": {"via": "ssh", "login_env": login}}, env={"NCCL_SOCKET_IFNAME": "lo"},
                       workers=[{"NCCL_SOCKET_IFNAME": "lo"}] * 2)
    clean = record("2", config={"launch": {"via": "ssh", "clean_env": True, "login_env": login}}, workers=[{}] * 2)
    diff = diff_runs(inherited, clean)
    [row] = [c for c in diff.explain() if c.key == "NCCL_SOCKET_IFNAME" and c.section == "workers"]
    assert (row.a, row.b) == ("lo x2", "unset x2") and "in B's login environment, not in its workers" in row.note
    assert diff.identical["login environment"] == 2 and "\nlogin environment (2 identical" in diff.render()
    assert not [k for k in (r.key for r in diff.sections["config"]) if "login_env" in k]


def test_fewer_processes_read_and_per_start_names_are_no_cause():
    vllm = {"NCCL_BUFFSIZE": "16777216"}
    a = run("1", env=vllm, workers=[{**vllm, "VLLM_DIST_IDENT": "a1"}] * 6)
    b = run("2", env=vllm, workers=[{**vllm, "VLLM_DIST_IDENT": "b2"}] * 2)
    rows = {r.key: r for r in diff_runs(a, b).sections["workers"]}
    assert rows["NCCL_BUFFSIZE"].a == "16777216 x6" and rows["NCCL_BUFFSIZE"].b == "16777216 x2"
    assert "only the number of processes read differs" in rows["NCCL_BUFFSIZE"].note
    assert "set anew by the engine at every start" in rows["VLLM_DIST_IDENT"].note
    assert not [c for c in diff_runs(a, b).explain() if c.section == "workers"]
