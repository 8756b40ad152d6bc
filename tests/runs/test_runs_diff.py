import re

from eyas.runs.diff import argv_options, diff_runs
from eyas.runs.record import RunRecord, WorkerEnv

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
