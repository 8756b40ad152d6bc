"""bench_smollm2's sweep: settings parsed with SGLang's meaning, bad ones refused in one line; every engine
is built before any is timed, and the rounds alternate their order, so the reported speed is the median."""

import sys
from pathlib import Path

import pytest

from eyas import execution_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_smollm2 as bench  # noqa: E402


def test_specs_take_sglang_meaning():
    specs = bench.parse_specs("3/1, 5/4/8,4/2")
    assert [bench.spec_name(s) for s in specs] == ["3/1/4", "5/4/8", "4/2/9"]


@pytest.mark.parametrize("text", ["3/x", "3", "3/1/4/5", "0/1", "5/4/99"])
def test_bad_specs_are_one_line(text):
    with pytest.raises(SystemExit) as e:
        bench.parse_specs(text)
    message = str(e.value)
    assert "\n" not in message and message


def test_engines_are_built_first_and_timed_in_alternating_rounds(monkeypatch):
    events = []
    speeds = {"plain": [100.0, 120.0, 110.0], "3/1/4": [150.0, 130.0, 170.0], "5/4/8": [90.0, 95.0, 80.0]}

    def engine(model_path, dtype, warm_prompt, draft=None, spec=None):
        name = bench.spec_name(spec) if spec else "plain"
        events.append(("build", name))
        return name

    def timed_run(eng, prompts, new_tokens=None):
        events.append(("time", eng))
        tok_s = speeds[eng][sum(1 for kind, n in events if kind == "time" and n == eng) - 1]
        return dict(tok_s=tok_s, tokens=11 * len(prompts), seconds=1.0, passes=5 * len(prompts))

    def phases(eng, prompt, new_tokens=None):
        return dict(phases={"verify": dict(mean_ms=1.0)}, accept_rate_by_position={0: 0.7})

    monkeypatch.setattr(bench, "eyas_engine", engine)
    monkeypatch.setattr(bench, "timed_run", timed_run)
    monkeypatch.setattr(bench, "cycle_phases", phases)
    res = bench.sweep("model", [[1, 2], [3]], "draft", bench.parse_specs("3/1,5/4/8"), rounds=3)

    assert [e for e in events[:3]] == [("build", "plain"), ("build", "3/1/4"), ("build", "5/4/8")]
    timed = [n for kind, n in events if kind == "time"]
    assert timed == ["plain", "3/1/4", "5/4/8", "5/4/8", "3/1/4", "plain", "plain", "3/1/4", "5/4/8"]
    assert res["plain_tok_s"] == 110.0 and res["plain_tok_s_rounds"] == [100.0, 120.0, 110.0]
    chain, tree = res["rows"]
    assert chain["tok_s"] == 150.0 and chain["over_plain"] == pytest.approx(150 / 110)
    assert tree["tok_s"] == 90.0 and tree["accept_length"] == pytest.approx((22 - 2) / 10)
    assert res["best_chain"] == "3/1/4" and res["best_tree"] == "5/4/8"


def topk_probe():
    """'0' while the plan's top-k kernel is off (the twin's setting), else None."""
    return None if execution_plan.current().topk_kernel else "0"


def rows_probe():
    """The plan's q/k/v + rotary rows as text while changed from the default, else None."""
    rows = execution_plan.current().qkv_rotary_rows
    return None if rows == execution_plan.DEFAULT.qkv_rotary_rows else str(rows)


def test_a_twin_of_each_setting_is_built_with_its_variable_set(monkeypatch):
    built = []

    def engine(model_path, dtype, warm_prompt, draft=None, spec=None):
        name = bench.spec_name(spec) if spec else "plain"
        built.append((name, topk_probe()))
        return f"{name}:{built[-1][1]}"

    ran = []  # (engine, the variable as it ran): graphs captured at longer contexts read it then

    def timed_run(eng, prompts, new_tokens=None):
        ran.append((eng, topk_probe()))
        return dict(tok_s=200.0 if eng.endswith(":None") else 100.0, tokens=11, seconds=1.0, passes=5)

    def cycle_phases(eng, prompt):
        ran.append((eng, topk_probe()))
        return dict(phases={}, accept_rate_by_position={})

    monkeypatch.setattr(bench, "eyas_engine", engine)
    monkeypatch.setattr(bench, "timed_run", timed_run)
    monkeypatch.setattr(bench, "cycle_phases", cycle_phases)
    twin = bench.parse_twin("topk_kernel=0")
    res = bench.sweep("model", [[1, 2]], "draft", bench.parse_specs("3/1,5/4/8"), rounds=1, twin=twin)
    assert built == [("plain", None), ("plain", "0"), ("3/1/4", None), ("3/1/4", "0"), ("5/4/8", None),
                     ("5/4/8", "0")]
    assert [r["spec"] for r in res["rows"]] == ["3/1/4", "3/1/4 topk_kernel=0", "5/4/8", "5/4/8 topk_kernel=0"]
    assert [r["tok_s"] for r in res["rows"]] == [200.0, 100.0, 200.0, 100.0]
    assert execution_plan.current() == execution_plan.DEFAULT and res["best_chain"] == "3/1/4"
    assert res["plain_twin"] == "plain topk_kernel=0" and res["plain_twin_tok_s"] == 100.0
    assert len(ran) == 6 + 4 and all(eng.split(":")[1] == str(env) for eng, env in ran)


def test_a_twin_may_set_several_variables():
    twin = bench.parse_twin("EYAS_A=1, EYAS_B=8")
    assert twin == ("EYAS_A", "1", "EYAS_B", "8") and bench.twin_name(twin) == "EYAS_A=1,EYAS_B=8"


@pytest.mark.parametrize("text", ["EYAS_X", "=1", "EYAS_X=", "EYAS_X=1,", "EYAS_X=1,EYAS_Y"])
def test_a_bad_twin_is_one_line(text):
    with pytest.raises(SystemExit) as e:
        bench.parse_twin(text)
    assert "\n" not in str(e.value)


def test_scaling_books_the_adaptive_run_by_bucket(monkeypatch, tmp_path):
    """The scaling section's adaptive rows say where the timed run's time went, per bucket and mode, and
    those windows hold every token the run's steps produced (each sequence's first comes from its prefill);
    each round's books say the same for that round, with its wall time and prefill seconds."""
    from tests.helpers import random_draft, tiny_llama

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    tiny_llama(tmp_path, vocab=128, layers=3, hidden=64)
    out = bench.batch_scaling(tmp_path, [[1, 2, 3, 4, 5], [6, 7, 8, 9]], random_draft(64, 128, draft_vocab=64),
                              [1, 3], new_tokens=24)
    for row in out["rows"]:
        books = row["adaptive_time_by_bucket"]
        assert books and all(v["seconds"] > 0 for v in books.values())
        assert sum(v["tokens"] for v in books.values()) == row["batch"] * (24 - 1)
        (only,) = row["adaptive_rounds_books"]  # one round: the same windows as the last run's books
        assert only["by_bucket"] == books and only["seconds"] > sum(v["seconds"] for v in books.values())
        assert 0 < only["prefill"] < only["seconds"]
        for mode in ("plain", "chain", "adaptive"):
            (phases,) = row[f"{mode}_phases_rounds"]
            assert phases["first_step"] > 0 and phases["full"] >= 0 and phases["tail"] >= 0
            assert phases["first_step"] + phases["full"] + phases["tail"] == pytest.approx(phases["seconds"], abs=2e-3)
        assert row["adaptive_phases_rounds"][0]["seconds"] == only["seconds"]


def test_scaling_builds_every_engine_first_and_times_in_alternating_rounds(monkeypatch, tmp_path):
    """The scaling section builds plain, chain and adaptive engines before it times any, runs each once
    untimed per batch size, then times the three in rounds of alternating order; a row holds every round's
    tok/s and their median, and is reported as soon as its batch size is measured."""
    from eyas.engine.engine import Engine
    from tests.helpers import random_draft, tiny_llama

    events = []

    class Recorded(Engine):
        def __init__(self, *args, **kwargs):
            spec = kwargs.get("spec")
            self.mode = "plain" if spec is None else "adaptive" if spec.adaptive else "chain"
            events.append(("build", self.mode))
            super().__init__(*args, **kwargs)

        def add(self, prompt_ids, params):
            if not self.has_work():  # a run's first request: generate's, or the timed runs' own loop
                events.append(("run", self.mode))
            return super().add(prompt_ids, params)

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "Engine", Recorded)
    tiny_llama(tmp_path, vocab=128, layers=3, hidden=64)
    reported = []
    out = bench.batch_scaling(tmp_path, [[1, 2, 3, 4, 5], [6, 7, 8, 9]], random_draft(64, 128, draft_vocab=64),
                              [1, 2], new_tokens=10, rounds=3, report=lambda row: reported.append((len(events), row)))
    # each row as soon as its batch size is measured: batch 1's before batch 2's 3 untimed and 9 timed runs
    assert [row for _, row in reported] == out["rows"] and [i for i, _ in reported] == [len(events) - 12, len(events)]
    builds = [i for i, e in enumerate(events) if e[0] == "build"]
    assert [events[i][1] for i in builds] == ["plain", "chain", "adaptive"]
    runs = [mode for kind, mode in events[builds[-1] + 1:] if kind == "run"]
    assert runs[-12:] == ["plain", "chain", "adaptive"] + ["plain", "chain", "adaptive", "adaptive", "chain", "plain",
                                                           "plain", "chain", "adaptive"]
    row = out["rows"][1]
    for mode in ("plain", "chain", "adaptive"):
        rounds = row[f"{mode}_tok_s_rounds"]
        assert len(rounds) == 3 and row[f"{mode}_tok_s"] == pytest.approx(sorted(rounds)[1], rel=1e-3)
    assert out["rounds"] == 3


def test_cycle_profiles_time_each_setting_as_it_runs_and_with_its_twin(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "cycle_profile", lambda model_path, prompt, draft, spec, cycles:
                        calls.append((bench.spec_name(spec), rows_probe())) or len(calls))
    rows = bench.cycle_profiles("model", [1, 2, 3], "draft")
    assert list(rows) == ["chain", "tree"]
    assert calls == [("3/1/4", None), ("5/4/8", None)]
    calls.clear()
    rows = bench.cycle_profiles("model", [1, 2, 3], "draft", twin=bench.parse_twin("qkv_rotary_rows=7"))
    assert list(rows) == ["chain", "chain qkv_rotary_rows=7", "tree", "tree qkv_rotary_rows=7"]
    assert [c[1] for c in calls] == [None, "7", None, "7"]
    assert execution_plan.current() == execution_plan.DEFAULT
    calls.clear()
    rows = bench.cycle_profiles("model", [1, 2, 3], "draft", specs=bench.parse_specs("4/2/8,3/1"))
    assert list(rows) == ["4/2/8", "3/1/4"] and calls == [("4/2/8", None), ("3/1/4", None)]


def test_a_cycle_profile_times_the_phases_of_steady_cycles(monkeypatch, tmp_path):
    from tests.helpers import random_draft, tiny_llama

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    tiny_llama(tmp_path, vocab=128, layers=3, hidden=64)
    row = bench.cycle_profile(tmp_path, list(range(3, 20)), random_draft(64, 128, draft_vocab=64), bench.CHAIN,
                              cycles=4)
    assert row["cycles"] == 4 and row["aten_ops_per_cycle"] > 0 and row["host_wall_ms"] > 0
    assert {"draft", "verify", "commit"} <= set(row["phase_ms_per_cycle"])
    assert all(v > 0 for v in row["phase_ms_per_cycle"].values())


def test_kernels_by_name_sums_launches_and_time_per_rep():
    from types import SimpleNamespace

    def kernel(name, us):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(elapsed_us=lambda: us))

    rows = bench.kernels_by_name([kernel("gemv", 3.0), kernel("norm", 1.0), kernel("gemv", 5.0),
                                  kernel("x" * 100, 20.0)], 2)
    assert rows == [dict(name="x" * 80, calls=0.5, us=10.0), dict(name="gemv", calls=1.0, us=4.0),
                    dict(name="norm", calls=0.5, us=0.5)]


def test_lossless_runs_the_twin_one_prompt_at_a_time_against_plain_greedy(monkeypatch):
    """With a twin, plain, chain and tree run under its plan at batch 1 (where the persistent step applies), each
    compared with the same plain greedy outputs; an output that differs is counted and its divergence read."""
    built = []

    class Seq:
        def __init__(self, ids):
            self.output_ids, self.verify_passes = ids, 2

    class FakeEngine:
        def __init__(self, path, dtype, device, max_batch, max_len, draft=None, spec=None):
            self.rows = execution_plan.current().persistent_rows
            self.execution_plan_summary = {"persistent_rows": self.rows if dtype == "bf16" else 0}
            built.append((bench.spec_name(spec) if spec else "plain", max_batch, self.rows))

        def generate(self, prompts, params):  # the twin's tree differs on the second prompt
            bad = self.rows == 3 and built[-1][0] == bench.spec_name(bench.TREE)
            return [Seq([i, 7] if bad and i == 1 else [i, 5]) for i, _ in enumerate(prompts)]

    monkeypatch.setattr(bench, "Engine", FakeEngine)
    monkeypatch.setattr(bench, "divergence_gaps", lambda plain, prompts, want, got: [dict(index=1, gap=0.5)])
    res = bench.lossless("model", [[1], [2]], "draft", twin=bench.parse_twin("persistent_rows=3"))
    chain, tree = bench.spec_name(bench.CHAIN), bench.spec_name(bench.TREE)
    default = execution_plan.DEFAULT.persistent_rows
    assert default != 3  # the twin differs from the default plan
    assert built == [("plain", 16, default), (chain, 16, default), (tree, 16, default), ("plain", 1, 3), (chain, 1, 3),
                     (tree, 1, 3)]
    assert set(res) == {"chain", "tree", "plain persistent_rows=3", "chain persistent_rows=3",
                        "tree persistent_rows=3"}
    assert all(res[k]["identical"] == 2 for k in res if k != "tree persistent_rows=3")
    assert res["tree persistent_rows=3"]["identical"] == 1 and res["tree persistent_rows=3"]["divergences"]
    assert all(res[k]["in_force"] == {"persistent_rows": 0} for k in res if "=" in k)  # fp32: the kernel declined
    assert all("in_force" not in res[k] for k in ("chain", "tree"))
    res = bench.lossless("model", [[1], [2]], "draft", dtype="bf16", twin=bench.parse_twin("persistent_rows=3"))
    assert all(res[k]["in_force"] == {"persistent_rows": 3} for k in res if "=" in k)
    assert execution_plan.current() == execution_plan.DEFAULT
