"""bench_train_step times a training step by phase through the trainer's own code; bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_steps_are_timed_on_the_cpu(tmp_path):
    out = tmp_path / "step.json"
    p = run("--shape", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--batch-tokens", "2048",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    row = json.loads(out.read_text())["runs"]["2048"]
    assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
    assert 520 < row["mean_padded_tokens"] <= 2048
    assert row["target_ms"] is None  # phases are CUDA-event times: none on the CPU


def test_bad_input_is_one_line_and_exit_2():
    cases = (["--shape", "huge"], ["--batch-tokens", "a"], ["--batch-tokens", "512"], ["--steps", "0"])
    # The first case as a real process (the script's own exit), the others in this one (no torch import each).
    runs = [run("--device", "cpu", *cases[0])] + [run_script(SCRIPT, "--device", "cpu", *args) for args in cases[1:]]
    for args, p in zip(cases, runs):
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_train_step: error:")
