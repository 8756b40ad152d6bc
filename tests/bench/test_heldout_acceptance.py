"""benchmarks/heldout_acceptance.py: one line for bad input, and a measured table on the demo model."""

import json
from pathlib import Path

import pytest

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_acceptance.py"
DRAFT = Path(__file__).resolve().parents[2] / "assets" / "smollm2-135m-eagle3"


@pytest.mark.parametrize("args, says", [
    (["--specs", "3-1-4"], "STEPS/TOPK/DRAFT_TOKENS"),
    (["--sets", "mt-bench,alpaca"], "alpaca"),
    (["--prompts", "0"], "positive"),
])
def test_bad_input_is_one_line(args, says):
    got = run_script(SCRIPT, "--draft", DRAFT, *args)
    assert got.returncode != 0 and says in got.stderr and len(got.stderr.strip().splitlines()) == 1


def test_not_a_draft_directory(tmp_path):
    got = run_script(SCRIPT, "--draft", tmp_path)
    assert got.returncode != 0 and "not a draft directory" in got.stderr


def test_measures_each_set_and_setting(tmp_path):
    out = tmp_path / "r.json"
    got = run_script(SCRIPT, "--draft", DRAFT, "--sets", "sharegpt", "--prompts", "2", "--new-tokens", "12",
                     "--specs", "2/1/3,2/2/4", "--json", out, "--markdown", tmp_path / "t.md")
    assert got.returncode == 0, got.stderr
    rows = json.loads(out.read_text())
    assert [r["spec"] for r in rows] == ["2/1/3", "2/2/4"]
    for r in rows:  # each verify pass emits between 1 and steps + 1 tokens
        assert r["passes"] > 0 and 1.0 <= r["generated"] / r["passes"] <= 3.0
        assert r["accept_length"] == round(r["generated"] / r["passes"], 3)
    assert "| sharegpt | 2 |" in (tmp_path / "t.md").read_text()
