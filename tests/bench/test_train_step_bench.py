"""bench_train_step times a training step by phase through the trainer's own code; bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

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
    for args in (["--shape", "huge"], ["--batch-tokens", "a"], ["--batch-tokens", "512"], ["--steps", "0"]):
        p = run("--device", "cpu", *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("bench_train_step: error:")
