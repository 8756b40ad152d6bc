"""eyas demo: the embedded SmolLM2 target, plain and with its trained EAGLE-3 draft, side by side.

Usage: eyas demo [--device cpu|cuda] [--max-tokens 96] [--no-bench]

It says what it will do, answers two questions greedily with the target alone and with the draft (the same text:
speculation is lossless), reports the speedup measured here and why it does or does not pay, beside a GPU figure
from a data file shipped in the package (demo_reference.json, which names its source). It ends by launching
`eyas serve` twice (without and with the draft), benchmarking each on MT-bench prompts, and recording both runs
in the ledger, where `eyas runs list/show/diff` find them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib import resources
from pathlib import Path

from eyas.options import get as option

# Greedy answers of SmolLM2-135M-Instruct to these end on their own (no loops) within the default 96 tokens.
QUESTIONS = ["Explain in three sentences why the sky is blue.",
             "Give three tips for someone learning to cook."]
SPEC = (3, 1)  # the draft's chain: 3 steps, top-1 (4 tokens per verify)


def bundled_draft() -> Path | None:
    """The demo draft shipped in the repository's assets/ (or $EYAS_DEMO_DRAFT)."""
    env = option("EYAS_DEMO_DRAFT")
    if env:
        return Path(env)
    path = Path(__file__).resolve().parents[3] / "assets" / "smollm2-135m-eagle3"
    return path if (path / "config.json").exists() else None


def gpu_reference() -> dict:
    """The GPU figure shown beside this machine's: a small data file shipped in the package, naming its source."""
    return json.loads(resources.files("eyas.commands").joinpath("demo_reference.json").read_text())


def add_arguments(p):
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer at most (default 96)")
    p.add_argument("--no-bench", action="store_true", help="skip the recorded server benchmark at the end")
    p.add_argument("--bench-prompts", type=int, default=2, help="MT-bench prompts per recorded benchmark run "
                                                                  "(default 2)")
    p.add_argument("--port", type=int, default=8431, help="port of the servers the recorded benchmark starts")


def load_line() -> str:
    """This machine's CPU load, said beside every timing: other processes slow both runs and blur the ratio."""
    cores = os.cpu_count() or 1
    one, five, _ = os.getloadavg()
    busy = " (busy: other processes share these cores, so timings are slower and noisier)" if one > cores / 2 else ""
    return f"load average {one:.2f} (1 min) / {five:.2f} (5 min) on {cores} cores{busy}"


def run(args) -> int:
    import torch

    from eyas.config import ModelConfig, SpecConfig
    from eyas.engine.engine import Engine
    from eyas.errors import EyasError
    from eyas.layers.sampling import SamplingParams
    from eyas.models.demo import demo_model_path
    from eyas.models.tokenizer import encode_prompt, load_tokenizer

    # Checked before the demo's generation, which takes a while, rather than when the bench starts after it.
    if args.device == "cuda" and not torch.cuda.is_available():
        raise EyasError("--device cuda was asked for but no CUDA device is available")
    params = SamplingParams(max_tokens=args.max_tokens)
    if not args.no_bench and args.bench_prompts < 1:
        raise EyasError(f"--bench-prompts must be >= 1, got {args.bench_prompts}")
    if not args.no_bench and not 1 <= args.port <= 65535:
        raise EyasError(f"--port must be in 1..65535, got {args.port}")
    max_len = 1024
    if params.max_tokens + 200 > max_len:  # the questions' chat prompts are under 200 tokens
        raise EyasError(f"--max-tokens must be at most {max_len - 200} for the demo, got {params.max_tokens}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if device == "cuda" else "fp32"
    draft = bundled_draft()
    path = demo_model_path()
    threads = ""
    if device == "cpu":
        # The rule `eyas serve`'s worker follows (every core; OMP_NUM_THREADS overrides it on a busy machine).
        from eyas.dist.worker import cpu_thread_count

        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_thread_count(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                   else (os.cpu_count() or 1), 1))
        threads = f", {torch.get_num_threads()} torch thread(s) as the server's worker uses"
    print(f"eyas demo: SmolLM2-135M-Instruct ({path}) on {device}, {dtype}{threads}; {load_line()}")
    print(f"It will answer {len(QUESTIONS)} questions (greedy, up to {params.max_tokens} tokens each) with the "
          "target alone, then again with its EAGLE-3 draft (chain 3/1/4), and compare speed and text"
          + ("" if args.no_bench else
             f"; then serve and benchmark both ({args.bench_prompts} MT-bench prompts x 64 tokens each) and record "
             "the two runs in the ledger") + ".", flush=True)
    tok = load_tokenizer(path)
    prompts = [encode_prompt(tok, q, chat=True) for q in QUESTIONS]
    runs = [("plain", None, None)]
    if draft is not None:
        # Every step speculates: the comparison below explains a speculative cycle's cost and yield.
        runs.append(("EAGLE-3", str(draft), SpecConfig(*SPEC, adaptive=False)))
    else:
        print("no bundled draft found in assets/; running the plain target only", file=sys.stderr)
    ModelConfig.from_dir(path)
    results = {}
    for name, d, spec in runs:
        engine = Engine(str(path), dtype=dtype, device=device, draft=d, spec=spec, max_batch=1, max_len=max_len)
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # first-call costs out of the timing
        seqs, secs = [], 0.0
        for p in prompts:
            t0 = time.perf_counter()
            seqs.append(engine.generate([p], params)[0])
            secs += time.perf_counter() - t0
        results[name] = (seqs, secs)
        toks = sum(len(s.output_ids) for s in seqs)
        acc = ""
        if spec:
            passes = max(sum(s.verify_passes for s in seqs), 1)
            acc = f", acceptance length {sum(len(s.output_ids) - 1 for s in seqs) / passes:.2f}"
        print(f"\n== {name}: {toks} tokens in {secs:.2f} s ({toks / secs:.1f} tok/s{acc})")
        for q, s in zip(QUESTIONS, seqs):
            print(f"-- {q} ({len(s.output_ids)} tokens)")
            print(tok.decode(s.output_ids, skip_special_tokens=True).strip())
    if len(results) == 2:
        report_speedup(results, device, dtype)
    if not args.no_bench:
        recorded_bench(draft, device, args)
    return 0


def report_speedup(results: dict, device: str, dtype: str) -> None:
    """Speculation against plain on this machine, why it does (not) pay here, and the GPU figure beside it."""
    (plain, plain_s), (spec, spec_s) = results["plain"], results["EAGLE-3"]
    same = [s.output_ids for s in plain] == [s.output_ids for s in spec]
    plain_toks, spec_toks = sum(len(s.output_ids) for s in plain), sum(len(s.output_ids) for s in spec)
    cycles = max(sum(s.verify_passes for s in spec), 1)
    step_ms = 1e3 * plain_s / plain_toks
    cycle_ms = 1e3 * spec_s / cycles
    per_cycle = spec_toks / cycles
    speedup = (spec_toks / spec_s) / (plain_toks / plain_s)
    print(f"\nspeculative output identical to plain greedy output: {same}")
    print(f"speedup on this machine ({device}, {dtype}): {speedup:.2f}x. A plain step took {step_ms:.1f} ms; a "
          f"speculative cycle took {cycle_ms:.1f} ms and gave {per_cycle:.2f} tokens, so it pays while a cycle costs "
          f"less than {per_cycle:.2f} plain steps ({per_cycle * step_ms:.1f} ms).")
    if speedup < 1.05:
        print("Here it does not pay: the draft's 3 steps and the 4-token verify together cost about as much as "
              f"the {per_cycle:.2f} plain steps they replace"
              + (" (on a CPU each pass pays its per-op overhead, and the verify reads the weights as a step does)"
                 if device == "cpu" else "") + f"; {load_line()}.")
    ref = gpu_reference()
    print(f"For comparison, on {ref['hardware']} ({ref['dtype']}, {ref['workload']}): plain {ref['plain_tok_s']:.1f} "
          f"tok/s, EAGLE-3 {ref['spec']} {ref['spec_tok_s']:.1f} tok/s ({ref['spec_tok_s'] / ref['plain_tok_s']:.2f}x, "
          f"acceptance length {ref['accept_length']:.2f}); source: {ref['source']}.")


def recorded_bench(draft: Path | None, device: str, args):
    """Serve the demo without and with its draft, bench each, record both in the ledger."""
    from eyas.launch.launch import launch, plan_for
    from eyas.launch.launch_host import LocalHost
    from eyas.launch.launch_config import BenchConfig, LaunchConfig
    from eyas.ledger.ledger import Ledger

    bench = BenchConfig(dataset="mt-bench", num_prompts=args.bench_prompts, concurrency=1, max_tokens=64)
    extra = ["--device", device]
    configs = [LaunchConfig(backend="eyas", model="demo", port=args.port, bench=bench, extra_args=extra)]
    if draft is not None:
        configs.append(LaunchConfig(backend="eyas", model="demo", draft=str(draft), spec_steps=3, spec_topk=1,
                                    port=args.port, bench=bench, extra_args=extra))
    print("\n== recorded benchmark: eyas serve + eyas bench (MT-bench, "
          f"{args.bench_prompts} prompts, 64 tokens, concurrency 1)")
    ids = []
    host = LocalHost(None)
    with Ledger() as ledger:
        for config in configs:
            outcome = launch(plan_for(config, host), host, ledger, launched_by=["eyas", "demo"])
            r = outcome.results
            acc = r.get("accept_length")
            print(f"run {outcome.run_id}: {'with draft' if config.draft else 'no draft'}: "
                  f"{r.get('output_tok_s', 0):.1f} output tok/s"
                  + (f", acceptance length {acc:.2f}" if acc else "") + ("" if outcome.ok else " (FAILED)"))
            ids.append(outcome.run_id)
    print("\nwhere to look: `eyas runs list`, `eyas runs show " + ids[-1] + "`"
          + (f", `eyas runs diff {ids[0]} {ids[-1]}`" if len(ids) == 2 else ""))
