import csv
import io
import json
import subprocess
import sys

import pytest

from eyas.cli import main
from eyas.ledger.ledger import Ledger


@pytest.fixture
def filled(home):
    with Ledger() as ledger:
        for steps, tok_s, proto in [(2, 94.0, "LL"), (3, 61.7, None), (2, 88.0, None), (4, 70.0, "LL")]:
            env = {"NCCL_PROTO": proto} if proto else {}
            run_id = ledger.start_run("bench", ["eyas", "bench", "--spec-steps", str(steps), "--prompt", "it's"],
                                      "/w", env, {"spec_steps": steps}, model="/models/llama")
            ledger.add_worker_env(run_id, "tp0", env, {"pid": 1})
            ledger.finish_run(run_id, "ok", {"output_tok_s": tok_s})
        ledger.start_run("serve", ["eyas", "serve"], "/w", {}, {"spec_steps": 2})
    return home


def eyas(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_where_sort_limit(filled, capsys):
    code, out, _ = eyas(capsys, "runs", "list")
    assert code == 0 and len(out.splitlines()) == 2 + 5 and out.splitlines()[2].startswith("5-")
    code, out, _ = eyas(capsys, "runs", "list", "--where", "config.spec_steps=2", "--where", "kind=bench",
                        "--sort", "output_tok_s", "--limit", "1")
    assert code == 0 and out.splitlines()[2].startswith("1-") and len(out.splitlines()) == 3
    assert "results.output_tok_s" in out.splitlines()[0] and "94" in out


def test_show_has_everything_and_the_reproducing_command(filled, capsys):
    code, out, _ = eyas(capsys, "runs", "show", "1")
    assert code == 0
    assert "command: env NCCL_PROTO=LL eyas bench --spec-steps 2 --prompt 'it'\"'\"'s'" in out
    assert "spec_steps = 2" in out and "output_tok_s = 94.0" in out and "tp0" in out
    code, out, _ = eyas(capsys, "runs", "show", "1", "--json")
    assert json.loads(out)["results"] == {"output_tok_s": 94.0}


def test_best_and_lower_is_better(filled, capsys):
    code, out, _ = eyas(capsys, "runs", "best", "--metric", "output_tok_s")
    assert code == 0 and out.startswith("1-") and "94.0" in out and "command: env NCCL_PROTO=LL" in out
    code, out, _ = eyas(capsys, "runs", "best", "--metric", "output_tok_s", "--lower-is-better")
    assert out.startswith("2-")
    code, out, _ = eyas(capsys, "runs", "best", "--metric", "output_tok_s", "--where", "env.NCCL_PROTO=LL",
                        "--lower-is-better")
    assert out.startswith("4-")


def test_diff(filled, capsys):
    code, out, _ = eyas(capsys, "runs", "diff", "1", "2")
    assert code == 0 and "-34.4%" in out
    assert out.split("most plausible explanations, in order:\n")[1].startswith("1. [workers] NCCL_PROTO")


def test_export_jsonl_and_csv(filled, capsys, tmp_path):
    code, out, _ = eyas(capsys, "runs", "export")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["run_id"].split("-")[0] for r in records] == ["1", "2", "3", "4", "5"]
    target = tmp_path / "runs.csv"
    code, _, err = eyas(capsys, "runs", "export", "--format", "csv", "--out", str(target), "--where", "kind=bench")
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    assert code == 0 and len(rows) == 4 and "wrote 4 runs" in err
    assert rows[0]["results.output_tok_s"] == "94.0" and rows[0]["env.NCCL_PROTO"] == "LL"
    assert rows[0]["command"].startswith("env NCCL_PROTO=LL eyas bench")


def test_plot_writes_a_png(filled, capsys, tmp_path):
    for by in ("spec_steps", "env.NCCL_PROTO"):
        out = tmp_path / f"{by}.png"
        code, _, _ = eyas(capsys, "runs", "plot", "--metric", "output_tok_s", "--by", by, "--out", str(out))
        assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["show", "99"], "no run '99'"),
    (["show", "abc"], "not a run id"),
    (["diff", "1", "77"], "no run '77'"),
    (["list", "--where", "spec_steps"], "expected KEY=VALUE"),
    (["list", "--where", "bogus=1"], "unknown field 'bogus'"),
    (["list", "--where", "config.spec_steps=9"], "no runs match"),
    (["best", "--metric", "nope"], "no finished run"),
    (["plot", "--metric", "output_tok_s", "--by", "nope", "--out", "x.png"], "no runs have both"),
])
def test_errors_are_one_line_exit_2(filled, capsys, argv, message):
    code, out, err = eyas(capsys, "runs", *argv)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_no_ledger_yet(capsys, home):
    code, _, err = eyas(capsys, "runs", "list")
    assert code == 2 and "no runs recorded yet" in err
    assert not (home / "runs.db").exists()  # reading does not create a ledger


def test_missing_action_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["runs"])
    assert e.value.code == 2


def test_runs_list_does_not_import_torch(filled):
    code = ("import sys; from eyas.cli import main; rc = main(['runs', 'list']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_list_shows_tok_s(filled, capsys):
    code, out, _ = eyas(capsys, "runs", "list", "--where", "kind=bench")
    header, _, *rows = out.splitlines()
    col = header.index("tok/s")
    assert code == 0 and [r[col:].split()[0] for r in rows] == ["70.0", "88.0", "61.7", "94.0"]


def test_best_compares_like_with_like_and_says_so(home, capsys):
    with Ledger() as ledger:
        for dataset, prompts, tok_s in [("mt-bench", 80, 94.0), ("mt-bench", 80, 90.0), ("humaneval", 8, 140.0)]:
            run_id = ledger.start_run("bench", ["eyas", "bench"], "/w", {},
                                      {"dataset": dataset, "num_prompts": prompts, "max_tokens": 256})
            ledger.finish_run(run_id, "ok", {"output_tok_s": tok_s})
    code, out, _ = eyas(capsys, "runs", "best", "--metric", "output_tok_s")
    blocks = out.split("\n\n")
    assert code == 0 and blocks[0].startswith("1-") and "94.0" in blocks[0]  # not the humaneval 140
    assert "the best of 2 run(s) on dataset mt-bench, 80 prompts, max tokens 256" in blocks[0]
    assert blocks[1].startswith("3-") and "dataset humaneval, 8 prompts" in blocks[1]
    assert "2 workloads" in blocks[2] and "not ranked against each other" in blocks[2]


def test_an_env_value_with_a_newline_keeps_tables_aligned(home, capsys):
    with Ledger() as ledger:
        for value in ("a\nb\tc", "plain"):
            run_id = ledger.start_run("bench", ["eyas", "bench"], "/w", {"NCCL_ODD": value}, {})
            ledger.add_worker_env(run_id, "tp0", {"NCCL_ODD": value}, {})
            ledger.finish_run(run_id, "ok", {"output_tok_s": 1.0})
    code, out, _ = eyas(capsys, "runs", "diff", "1", "2")
    table = out.split("\nenvironment")[1].split("\n\n")[0].splitlines()[1:]
    assert code == 0 and len(table) == 3 and "a\\nb\\tc" in table[2]
    assert table[2].index("plain") == table[0].index("B")  # the value did not push its row out of line
    code, out, _ = eyas(capsys, "runs", "show", "1")
    section = out.split("\nenvironment:\n")[1].split("\nworkers")[0]
    assert section == "  NCCL_ODD = a\\nb\\tc"  # the command line above keeps the real newline, quoted


def test_output_piped_into_head_ends_without_a_traceback(home, tmp_path):
    with Ledger() as ledger:
        ledger.start_run("bench", ["eyas", "bench"], "/w", {"NCCL_BIG": "x" * 300_000}, {})
    script = "import sys; from eyas.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(["bash", "-c", f"{sys.executable} -c '{script}' runs show 1 | head -1"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("run 1-") and done.stderr == ""


def test_an_empty_file_given_as_a_ledger_is_refused(tmp_path, capsys):
    empty = tmp_path / "runs.db"
    empty.touch()
    for argv in (["runs", "--db", str(empty), "list"], ["bench", "--url", "http://127.0.0.1:9", "--db", str(empty),
                                                        "--num-prompts", "1"]):
        code, _, err = eyas(capsys, *argv)
        assert "is an empty file, not a run ledger" in err
    assert empty.stat().st_size == 0  # left as it was, not initialised
