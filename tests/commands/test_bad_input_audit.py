"""Bad input found by an audit of every verb: each case is one line on stderr and exit 2, never a traceback."""

import json
import shutil

import pytest

from eyas.cli import main
from tests.helpers import tiny_llama


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eyas: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    tiny_llama(path, layers=2)
    return path


@pytest.mark.parametrize("config, needle", [("[1, 2]", "is not a JSON object"),
                                            ('{"architectures": ["LlamaForCausalLM"]}',
                                             "lacks required field 'num_attention_heads'")])
def test_generate_config_json_wrong_shape(capsys, tmp_path, tiny_dir, config, needle):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "config.json").write_text(config)
    code, _, err = run_cli(capsys, "generate", "--model", bad, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu")
    assert_one_line(code, err, needle)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_generate_temperature_not_finite(capsys, value):
    # Checked before any model is read: the directory does not need to exist.
    code, _, err = run_cli(capsys, "generate", "--model", "/nonexistent", "--prompt", "hi", "--device", "cpu",
                           "--temperature", value)
    assert_one_line(code, err, "temperature must be a finite number", value)


def test_convert_gguf_output_under_a_regular_file(capsys, tmp_path):
    from eyas.models.demo import demo_gguf_path

    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "convert-gguf", demo_gguf_path(), tmp_path / "file" / "sub" / "out")
    assert_one_line(code, err, "cannot create output directory", "is not a directory")
    assert (tmp_path / "file").read_text() == "x"


def test_generate_model_without_tokenizer_names_the_missing_files(capsys, tiny_dir):
    # transformers' own message is several lines, of which the first ends in "from one of:"
    code, _, err = run_cli(capsys, "generate", "--model", tiny_dir, "--prompt", "hi", "--max-tokens", "2",
                           "--device", "cpu")
    assert_one_line(code, err, "cannot load the tokenizer", "tokenizer.json")
    assert not err.rstrip().endswith(":"), err


@pytest.mark.parametrize("flag", ["--spec-steps", "--spec-topk", "--spec-draft-tokens"])
def test_generate_spec_settings_without_a_draft(capsys, flag):
    # They were ignored silently: the user believed they speculated. Checked before any model is read.
    code, _, err = run_cli(capsys, "generate", "--model", "/nonexistent", "--prompt", "hi", "--device", "cpu",
                           flag, "2")
    assert_one_line(code, err, "need --draft")


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "--prompt", "hi"]])
def test_spec_adaptive_without_a_draft_names_the_flag(capsys, command):
    code, _, err = run_cli(capsys, command[0], "--model", "/nonexistent", "--device", "cpu", *command[1:],
                           "--no-spec-adaptive")
    assert_one_line(code, err, "spec-adaptive", "need --draft")


@pytest.mark.parametrize("action", [["list"], ["show", "1"], ["export"], ["best", "--metric", "output_tok_s"]])
def test_runs_ledger_not_a_database(capsys, tmp_path, action):
    garbage = tmp_path / "runs.db"
    garbage.write_bytes(b"\x00\x01 not a database, but someone's file")
    code, _, err = run_cli(capsys, "runs", "--db", garbage, *action)
    assert_one_line(code, err, "cannot open the run ledger", "not a database")
    assert garbage.read_bytes() == b"\x00\x01 not a database, but someone's file"


def test_runs_ledger_is_a_directory(capsys, tmp_path):
    code, _, err = run_cli(capsys, "runs", "--db", tmp_path, "list")
    assert_one_line(code, err, "is a directory")


def test_ledger_under_a_regular_file(tmp_path):
    from eyas.errors import EyasError
    from eyas.ledger.ledger import Ledger

    (tmp_path / "file").write_text("x")
    for db in (tmp_path / "file" / "runs.db", tmp_path / "file" / "sub" / "runs.db"):
        with pytest.raises(EyasError, match="a folder above it is a regular file"):
            Ledger(db)


def test_bench_temperature_nan(capsys):
    # Checked before the server is contacted (nothing listens on port 1).
    code, _, err = run_cli(capsys, "bench", "--url", "http://127.0.0.1:1", "--no-record", "--temperature", "nan")
    assert_one_line(code, err, "--temperature must be a finite number")


@pytest.fixture
def ledger_db(tmp_path):
    from eyas.ledger.ledger import Ledger

    db = tmp_path / "runs.db"
    with Ledger(db) as ledger:
        for steps, tok_s in ((2, 10.0), (3, 11.0)):
            run_id = ledger.start_run(kind="bench", argv=["eyas", "bench"], cwd="/", env={},
                                      config={"spec_steps": steps})
            ledger.finish_run(run_id, "ok", {"output_tok_s": tok_s})
    return db


@pytest.mark.parametrize("where, needle", [("dir", "is a directory"), ("under_file", "is not a directory")])
@pytest.mark.parametrize("action", [["export"], ["plot", "--metric", "output_tok_s", "--by", "spec_steps"]])
def test_runs_out_unwritable(capsys, tmp_path, ledger_db, action, where, needle):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "dir" else tmp_path / "file" / "out.png"
    code, _, err = run_cli(capsys, "runs", "--db", ledger_db, *action, "--out", out)
    assert_one_line(code, err, "--out", needle)
    assert (tmp_path / "file").read_text() == "x"


def test_runs_plot_unknown_image_type(capsys, tmp_path, ledger_db):
    code, _, err = run_cli(capsys, "runs", "--db", ledger_db, "plot", "--metric", "output_tok_s", "--by",
                           "spec_steps", "--out", tmp_path / "p.xyz")
    assert_one_line(code, err, "unsupported image type '.xyz'")


def test_runs_plot_without_extension_reports_the_file_written(capsys, tmp_path, ledger_db):
    code, _, err = run_cli(capsys, "runs", "--db", ledger_db, "plot", "--metric", "output_tok_s", "--by",
                           "spec_steps", "--out", tmp_path / "p")
    assert code == 0 and (tmp_path / "p.png").is_file()
    assert f"wrote {tmp_path / 'p.png'} " in err, err


def test_runs_plot_without_extension_checks_the_png_it_writes(capsys, tmp_path, ledger_db):
    (tmp_path / "p.png").mkdir()
    code, _, err = run_cli(capsys, "runs", "--db", ledger_db, "plot", "--metric", "output_tok_s", "--by",
                           "spec_steps", "--out", tmp_path / "p")
    assert_one_line(code, err, f"--out {tmp_path / 'p.png'} is a directory")


def test_runs_list_negative_limit(capsys, ledger_db):
    # SQLite's LIMIT -1 means no limit: every run was listed.
    code, _, err = run_cli(capsys, "runs", "--db", ledger_db, "list", "--limit", "-1")
    assert_one_line(code, err, "--limit must be >= 1")


@pytest.mark.parametrize("key, needle", [("nosuch", "valid keys: kind, status,"),
                                         ("nosuch", "output_tok_s"),
                                         ("config.nosuch", "config.spec_steps"),
                                         ("env.NOSUCH", "no run records any env.X")])
def test_runs_list_unknown_sort_key(capsys, ledger_db, key, needle):
    # It listed every run with a column of None, in no meaningful order.
    code, out, err = run_cli(capsys, "runs", "--db", ledger_db, "list", "--sort", key)
    assert_one_line(code, err, f"unknown --sort key '{key}'", needle)
    assert out == ""


def test_runs_list_sort_key_some_runs_lack_is_fine(capsys, ledger_db):
    from eyas.ledger.ledger import Ledger

    with Ledger(ledger_db) as ledger:
        ledger.finish_run(ledger.start_run(kind="bench", argv=["eyas"], cwd="/", env={}, config={}), "ok",
                          {"ttft_ms": 3.0})
    code, out, _ = run_cli(capsys, "runs", "--db", ledger_db, "list", "--sort", "ttft_ms")
    assert code == 0 and "results.ttft_ms" in out


def test_runs_replay_threshold_nan(capsys, ledger_db):
    code, _, err = run_cli(capsys, "runs", "--db", ledger_db, "replay", "1", "--threshold", "nan")
    assert_one_line(code, err, "--threshold must be >= 0")


@pytest.mark.parametrize("where, needle", [("dir", "is a directory"), ("under_file", "is not a directory")])
def test_launch_from_shell_write_unwritable(capsys, tmp_path, where, needle):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "dir" else tmp_path / "file" / "config.toml"
    code, _, err = run_cli(capsys, "launch", "--from-shell", "eyas serve --model x", "--write", out)
    assert_one_line(code, err, "--write", needle)
    assert (tmp_path / "file").read_text() == "x"


def test_launch_config_missing_key_names_the_key_not_an_argument(capsys, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("tp = 1\n")
    code, _, err = run_cli(capsys, "launch", config, "--dry-run")
    assert_one_line(code, err, "missing required key", "'backend'", "'model'")
    assert "positional" not in err


@pytest.fixture
def tune_config(tmp_path, monkeypatch):
    import eyas.ledger.tune

    def no_sweep(*a, **k):
        raise AssertionError("the sweep started")

    monkeypatch.setattr(eyas.ledger.tune, "run_sweep", no_sweep)
    config = tmp_path / "config.toml"
    config.write_text('backend = "eyas"\nmodel = "/nonexistent/m"\ndraft = "/nonexistent/d"\n'
                      '[bench]\ndataset = "mt-bench"\nnum_prompts = 1\n')
    return config


def test_tune_env_sets_is_a_directory(capsys, tmp_path, tune_config):
    code, _, err = run_cli(capsys, "tune", "--config", tune_config, "--db", tmp_path / "runs.db",
                           "--env-sets", tmp_path)
    assert_one_line(code, err, "cannot read --env-sets", "Is a directory")


@pytest.mark.parametrize("where, needle", [("dir", "is a directory"), ("under_file", "is not a directory")])
def test_tune_plot_unwritable_is_refused_before_the_sweep(capsys, tmp_path, tune_config, where, needle):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "dir" else tmp_path / "file" / "p.png"
    code, _, err = run_cli(capsys, "tune", "--config", tune_config, "--db", tmp_path / "runs.db", "--plot", out)
    assert_one_line(code, err, "--plot", needle)


def test_tune_plot_without_extension_checks_the_png_it_writes_before_the_sweep(capsys, tmp_path, tune_config):
    # matplotlib writes p.png for --plot p: a directory there failed only after the sweep.
    (tmp_path / "p.png").mkdir()
    code, _, err = run_cli(capsys, "tune", "--config", tune_config, "--db", tmp_path / "runs.db",
                           "--plot", tmp_path / "p")
    assert_one_line(code, err, f"--plot {tmp_path / 'p.png'} is a directory")


def test_remote_mistyped_db_is_not_created(capsys, tmp_path):
    db = tmp_path / "typo.db"
    code, _, err = run_cli(capsys, "remote", "--db", db, "status", "1")
    assert_one_line(code, err, "does not exist")
    assert not db.exists()


@pytest.mark.parametrize("argv, needle", [(["logs", "1", "-n", "0"], "--lines must be >= 1"),
                                          (["logs", "1", "-n", "-5"], "--lines must be >= 1"),
                                          (["stop", "1", "--timeout", "-1"], "--timeout must be a positive"),
                                          (["stop", "1", "--timeout", "nan"], "--timeout must be a positive")])
def test_remote_bad_numbers(capsys, ledger_db, argv, needle):
    code, _, err = run_cli(capsys, "remote", "--db", ledger_db, *argv)
    assert_one_line(code, err, needle)


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    import eyas.train.pipeline

    def no_run(*a, **k):
        raise AssertionError("the pipeline started")

    monkeypatch.setattr(eyas.train.pipeline.Pipeline, "run", no_run)
    path = tmp_path / "recipe.toml"
    path.write_text('target = "/nonexistent/target"\n')
    return path


@pytest.mark.parametrize("device, needle", [("bogus", "device must be auto, cpu, cuda or cuda:N"),
                                            ("cuda:7", "no CUDA device is available")])
def test_train_bad_device(capsys, tmp_path, recipe, device, needle):
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    code, _, err = run_cli(capsys, "train", "--config", recipe, "--device", device, "--out", tmp_path / "out")
    assert_one_line(code, err, needle)


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_train_sharegpt_checked_before_any_stage(capsys, tmp_path, recipe, what):
    path = tmp_path / "nope.json" if what == "missing" else tmp_path
    code, _, err = run_cli(capsys, "train", "--config", recipe, "--device", "cpu", "--out", tmp_path / "out",
                           "--sharegpt", path)
    assert_one_line(code, err, "conversation file", "not found" if what == "missing" else "a directory")


@pytest.mark.parametrize("content, needle", [
    (b"\x8f\xff\x00garbage\xfe", "is not UTF-8 text"),
    (b'{\n  "data": [1, 2]\n}\n', "expected 'conversations' (ShareGPT) or 'messages' (OpenAI) list"),
    (b"[1, 2, 3]", "item 0: expected a JSON object, got int"),
    (b'"just a string"', "expected a JSON object, got str"),
    (b'[{"conversations": []}]', "has no conversation with a user turn"),
    (b"not json at all\n", "line 1: not valid JSON"),
])
def test_train_sharegpt_content_checked_before_any_stage(capsys, tmp_path, recipe, content, needle):
    # Read only by regen: a garbage file failed after synth had run (hours on a real recipe).
    path = tmp_path / "garbage.json"
    path.write_bytes(content)
    code, _, err = run_cli(capsys, "train", "--config", recipe, "--device", "cpu", "--out", tmp_path / "out",
                           "--sharegpt", path)
    assert_one_line(code, err, str(path), needle)


def test_train_sharegpt_pretty_printed_single_record_is_read(tmp_path):
    from eyas.train.prompts import read_conversations

    path = tmp_path / "one.json"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}, indent=2))
    (conv,) = read_conversations(path)
    assert conv.id == "a" and conv.first_user() == "hi"


@pytest.mark.parametrize("where, needle", [("file", "is a regular file"), ("under_file", "is not a directory")])
def test_train_out_unusable_checked_before_any_stage(capsys, tmp_path, recipe, where, needle):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" if where == "file" else tmp_path / "file" / "out"
    code, _, err = run_cli(capsys, "train", "--config", recipe, "--device", "cpu", "--out", out)
    assert_one_line(code, err, "output directory", needle)
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("argv, needle", [(["--device", "cuda"], "no CUDA device is available"),
                                          (["--bench-prompts", "0"], "--bench-prompts must be >= 1"),
                                          (["--port", "70000"], "--port must be in 1..65535")])
def test_demo_bad_input_before_the_demo_runs(capsys, monkeypatch, argv, needle):
    import torch

    import eyas.models.demo

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is available")

    def no_demo():
        raise AssertionError("the demo started")

    monkeypatch.setattr(eyas.models.demo, "demo_model_path", no_demo)
    code, _, err = run_cli(capsys, "demo", *argv)
    assert_one_line(code, err, needle)


def test_generate_prompt_file_not_utf8(capsys, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"caf\xe9 au lait\n")  # Latin-1, not UTF-8
    code, _, err = run_cli(capsys, "generate", "--model", "/nonexistent", "--prompt-file", path, "--device", "cpu")
    assert_one_line(code, err, str(path), "is not UTF-8 text", "byte 3")


def test_generate_missing_draft_is_named_as_the_draft(capsys, tiny_dir, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_dir, "--prompt", "hi", "--device", "cpu",
                           "--draft", tmp_path / "no-such-draft")
    assert_one_line(code, err, "draft directory not found", "no-such-draft")


def test_load_draft_missing_directory_names_the_draft(tmp_path):
    from eyas.errors import EyasError
    from eyas.models.draft_io import load_draft

    with pytest.raises(EyasError, match="draft directory not found"):
        load_draft(tmp_path / "gone")


@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_unknown_model_name_mentions_demo(capsys, verb):
    argv = ["--prompt", "hi"] if verb == "generate" else ["--port", "0"]
    code, _, err = run_cli(capsys, verb, "--model", "smollm2", "--device", "cpu", *argv)
    assert_one_line(code, err, "model directory not found: smollm2", "'demo'")


@pytest.mark.parametrize("flag, value, needle", [
    ("--spec-steps", 1000, "--spec-steps must be in 1..63"),
    ("--spec-topk", 100, "--spec-topk must be in 1..16"),
    ("--spec-draft-tokens", 100, "--spec-draft-tokens must be at most 64"),
])
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_spec_settings_bounded_by_what_the_engine_captures(capsys, tmp_path, verb, flag, value, needle):
    # Refused at once, before any model is read (the model path does not exist), and the bound is said.
    argv = [flag, value] + (["--spec-topk", 4, "--spec-steps", 8] if flag == "--spec-draft-tokens" else [])
    extra = ["--prompt", "hi"] if verb == "generate" else ["--port", "0"]
    code, _, err = run_cli(capsys, verb, "--model", "/nonexistent", "--device", "cpu", "--draft", tmp_path, *extra,
                           *argv)
    assert_one_line(code, err, needle)


def test_spec_bounds_agree_with_the_engine_limits():
    from eyas.config import MAX_SPEC_TOPK, MAX_VERIFY_TOKENS, SpecConfig
    from eyas.kernels.topk import MAX_K
    from eyas.layers.attention import KERNEL_TOKENS

    assert (MAX_VERIFY_TOKENS, MAX_SPEC_TOPK) == (KERNEL_TOKENS, MAX_K)
    assert SpecConfig(10, 8).draft_tokens == MAX_VERIFY_TOKENS  # the default is clamped, not refused


def test_generate_huge_max_tokens_refused_before_the_model_loads(capsys, monkeypatch, tiny_dir):
    import eyas.engine.engine

    def no_engine(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(eyas.engine.engine, "Engine", no_engine)
    code, _, err = run_cli(capsys, "generate", "--model", tiny_dir, "--prompt", "hi", "--device", "cpu",
                           "--max-tokens", 10 ** 9)
    assert_one_line(code, err, "--max-tokens 1000000000 exceeds the context")


def _options(parser):
    """(prog, option) for every argument of a parser and its sub-parsers."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser.prog, "/".join(action.option_strings) or action.dest, action.help


@pytest.mark.parametrize("verb", ["generate", "demo", "serve", "runs"])
def test_every_option_has_help_text(verb):
    import argparse
    import importlib

    from eyas.cli import VERBS

    parser = argparse.ArgumentParser(prog=f"eyas {verb}")
    importlib.import_module(VERBS[verb][0]).add_arguments(parser)
    missing = [f"{prog} {opt}" for prog, opt, text in _options(parser) if not text]
    assert not missing, missing


NO_TRITON = '''
import importlib.abc, sys


class NoTriton(importlib.abc.MetaPathFinder):
    """A torch without Triton: every `import triton` fails, as on a plain `pip install .` CPU machine."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
'''


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    from tests.server.tiny import predictable_pair

    root = tmp_path_factory.mktemp("pair")
    return predictable_pair(root / "target", root / "draft")


@pytest.fixture
def no_triton_env(tmp_path):
    """An environment whose Python processes (server workers included) cannot import triton."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TRITON)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "EYAS_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.mark.parametrize("spec", [[], ["--spec-steps", "3"], ["--spec-steps", "2", "--spec-topk", "2"]])
def test_generate_on_the_cpu_never_needs_triton(chat_pair, no_triton_env, spec):
    import subprocess
    import sys

    target, draft = chat_pair
    check = subprocess.run([sys.executable, "-c", "import triton"], env=no_triton_env, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'triton'" in check.stderr  # the hook works
    draft_args = ["--draft", str(draft), *spec] if spec else []
    run = subprocess.run([sys.executable, "-m", "eyas.cli", "generate", "--model", str(target), "--prompt", "hello",
                          "--max-tokens", "8", "--device", "cpu", "--json", *draft_args],
                         env=no_triton_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["num_tokens"] == 8 and "triton" not in run.stderr


def test_serve_on_the_cpu_never_needs_triton(chat_pair, no_triton_env):
    import httpx

    from tests.server.tiny import Server

    target, draft = chat_pair
    with Server(target, "--draft", str(draft), env=no_triton_env) as server:
        body = {"model": str(target), "prompt": "hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert "triton" not in server.log(), server.log()


def test_train_num_samples_holds_out_in_proportion_and_says_so(capsys, tmp_path, monkeypatch):
    import eyas.train.pipeline

    seen = {}

    class Fake:
        def __init__(self, recipe, progress=True, profile=False):
            seen["recipe"], seen["progress"] = recipe, progress

        def run(self, stages, argv=()):
            return {}

    monkeypatch.setattr(eyas.train.pipeline, "Pipeline", Fake)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('target = "demo"\n[data]\nheldout = 64\n[synth]\nnum = 1000\n')
    code, _, err = run_cli(capsys, "train", "--config", recipe, "--device", "cpu", "--out", tmp_path / "out",
                           "--num-samples", 8, "--no-progress")
    assert code == 0, err
    r = seen["recipe"]
    assert (r.data.heldout, r.synth.num, seen["progress"]) == (2, 10, False)  # not 64 held out and 72 synthesized
    assert "holding out 2 prompts, not [data] heldout = 64" in err
