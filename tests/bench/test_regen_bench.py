"""bench_regen runs the regen stage's engine and loop over the evaluation questions and reports what it wrote:
every prompt answered, the tokens counted, the same replies (hash) on a second run; bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

from tests.train.conftest import make_target

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_regen.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_every_prompt_is_answered_and_a_second_run_writes_the_same_replies(tmp_path):
    target = make_target(tmp_path / "target", stop_bias=3.6, sharpen=1.0)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'target = "{target}"\n[data]\nmax_len = 256\n[regen]\nmax_tokens = 12\nbatch = 4\n')
    results = []
    for i in range(2):
        out = tmp_path / f"regen{i}.json"
        p = run("--recipe", str(recipe), "--prompts", "7", "--device", "cpu", "--out", str(out))
        assert p.returncode == 0, p.stderr
        results.append(json.loads(out.read_text()))
    r = results[0]
    assert (r["prompts"], r["batch"], r["dtype"]) == (7, 4, "fp32")
    assert 0 < r["replies"] <= 7 and r["replies"] <= r["generated_tokens"] <= 7 * 12
    assert r["tokens_per_s"] > 0 and r["engine_steps"] >= r["generated_tokens"] / 4
    assert r["steps_ahead"] == 0  # no CUDA graphs on the CPU, so no step runs ahead of the host
    assert results[1]["replies_sha256"] == r["replies_sha256"] and len(r["replies_sha256"]) == 64


def test_a_missing_recipe_is_one_line_and_exit_2(tmp_path):
    p = run("--recipe", str(tmp_path / "none.toml"), "--device", "cpu")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_regen: recipe not found")
