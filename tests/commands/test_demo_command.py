"""`eyas demo`'s pieces that need no model: the shipped GPU figure, and the speedup report's arithmetic."""

import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

from eyas.commands import demo

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_reference_is_package_data_naming_its_source():
    ref = demo.gpu_reference()
    assert ref["plain_tok_s"] > 0 and ref["spec_tok_s"] > 0 and ref["accept_length"] > 1
    assert "BENCHMARKS.md" in ref["source"] and ref["hardware"]
    # Shipped in a wheel: pyproject's package data must cover the file.
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch("demo_reference.json", g) for g in data["eyas.commands"])


def test_speedup_report_uses_the_measured_numbers(capsys):
    def seq(n, passes):
        return SimpleNamespace(output_ids=list(range(n)), verify_passes=passes)

    plain = [seq(40, 39), seq(60, 59)]
    spec = [seq(40, 20), seq(60, 30)]
    demo.report_speedup({"plain": (plain, 10.0), "EAGLE-3": (spec, 10.0)}, "cpu", "fp32")
    out = capsys.readouterr().out
    assert "identical to plain greedy output: True" in out
    assert "1.00x" in out and "A plain step took 100.0 ms" in out and "took 200.0 ms and gave 2.00 tokens" in out
    assert "Here it does not pay" in out and "load average" in out
    assert "NVIDIA H200" in out

