"""Benchmark any OpenAI-compatible server: `run_benchmark(BenchConfig(...)) -> BenchResult`."""

from eyas.bench.client import run_benchmark
from eyas.bench.config import BenchConfig
from eyas.bench.datasets import Prompt, load_prompts
from eyas.bench.report import BenchResult

__all__ = ["BenchConfig", "BenchResult", "Prompt", "load_prompts", "run_benchmark"]
