"""Decode and verify steps of one model under several execution plans, side by side in one process.

Separate processes on the benchmark host differ by 5-15% for identical settings (docs/BENCHMARKS.md), more
than most single changes move a step. Here one random-weight model (SmolLM2's or an 8B Llama's shape, bf16,
batch 1) gets one set of CUDA graphs per variant, each captured under that variant's execution plan (the
kernels read the plan at launch, so a captured graph keeps it), and the variants are then replayed in
`--rounds` rounds, each round in the opposite order of the one before. Reported per variant and query count
T: the median over rounds of the median ms of `--reps` steps, every round's figure, and the ratio to the
first variant. `step` is the runner's forward and the logits as the engine calls them (host work included:
the GPU waits for it at batch 1), `replay` the forward's CUDA graph replayed back to back (the GPU's time).

    python3 benchmarks/bench_step_ab.py --shape smollm2 --context 300 \\
        --variants "default:;pdl_off:pdl=0;cublas_o:fused_o_proj=0" --out step_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from eyas import execution_plan
from ablation import plan_changes  # benchmarks/ablation.py
from bench_join import SMOLLM2
from bench_tp import LLAMA_8B, random_runner
from timing import kernel_table, median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

SHAPES = {"smollm2": SMOLLM2, "llama-8b": LLAMA_8B}
MAX_LEN = 2048
REPLAYS = 10  # graph replays per timed sample of the GPU-only figure
BLAS = ("cublas", "cublaslt")  # blas=...: torch's preferred BLAS library for the variant (this benchmark's own)


def use_blas(settings: dict):
    """Set torch's preferred BLAS library to the variant's blas (cuBLAS unless it names cuBLASLt): torch
    picks its GEMM kernels as it launches them, so a graph captured under the setting keeps that choice."""
    torch.backends.cuda.preferred_blas_library(settings.get("blas", "cublas"))


def plan_of(settings: dict) -> dict:
    """The variant's execution plan changes (execution_plan.using's keywords): every setting but blas."""
    return plan_changes({k: v for k, v in settings.items() if k != "blas"})


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'name:K=V,K=V;name2:' -> [(name, {K: V}), ...], K an execution plan field or blas; an empty setting list
    is the default plan."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, settings = part.partition(":")
        if not sep or not name:
            raise SystemExit(f"bench_step_ab: variant {part!r} is not NAME:[K=V,...]")
        env = {}
        for kv in filter(None, settings.split(",")):
            k, eq, v = kv.partition("=")
            if not eq or (k == "blas" and v not in BLAS):
                raise SystemExit(f"bench_step_ab: setting {kv!r} of {name} is not FIELD=VALUE (an execution plan "
                                 f"field, or blas: {' or '.join(BLAS)})")
            env[k] = v
        try:
            plan_of(env)
        except SystemExit as e:
            raise SystemExit(f"bench_step_ab: variant {name}: {e}") from None
        out.append((name, env))
    if len({n for n, _ in out}) != len(out) or not out:
        raise SystemExit("bench_step_ab: give one or more variants with distinct names")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(SHAPES), default="smollm2")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before each timed step")
    ap.add_argument("--tokens", default="1,4", help="query tokens per step (1: decode; more: a chain's verify)")
    ap.add_argument("--variants", required=True, help="NAME:[FIELD=V,...];... (execution plan fields, "
                    "or blas=cublaslt) the first is the reference")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="step_ab.json")
    ap.add_argument("--profile", action="store_true", help="also list each variant's kernels per graph replay "
                    "(torch.profiler; under PDL a kernel's time includes its wait for the one before)")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"bench_step_ab: --tokens {args.tokens!r} is not a comma-separated list of counts") from None
    if min(tokens) < 1 or max(tokens) > 64:
        raise SystemExit("bench_step_ab: --tokens must be counts from 1 to 64 (a graph's query lengths)")
    if not 1 <= args.context <= MAX_LEN - max(tokens) or args.rounds < 1:
        raise SystemExit(f"bench_step_ab: --context must be in 1..{MAX_LEN - max(tokens)}, --rounds >= 1")
    from eyas.engine.graphs import CudaGraphs

    from eyas.tensor_parallel import TPContext

    cfg, model, runner = random_runner(SHAPES[args.shape], TPContext(), args.context, MAX_LEN)
    steps = {}
    for T in tokens:
        x = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
        pos = torch.arange(args.context, args.context + T, device="cuda")[None]
        mask = None if T == 1 else torch.tril(torch.ones(T, T, dtype=torch.bool, device="cuda"))[None]
        steps[T] = (x, pos, mask)
    graphs = {}
    for name, env in variants:  # capture every variant's graphs under its own plan
        use_blas(env)
        with execution_plan.using(**plan_of(env)):
            graphs[name] = CudaGraphs(runner)
            runner.graphs = graphs[name]
            for T, (x, pos, mask) in steps.items():
                runner.forward(x, pos, [0], [args.context], new_mask=mask)

    def one(name, T):
        x, pos, mask = steps[T]
        runner.graphs = graphs[name]
        use_blas(dict(variants)[name])
        return model.logits(runner.forward(x, pos, [0], [args.context], new_mask=mask).hidden)

    def replays(name, T):
        """REPLAYS back-to-back replays of the forward's graph alone: the GPU's time, no host work between."""
        graph = next(g for key, g in graphs[name].graphs.items() if key[1] == T).graph
        for _ in range(REPLAYS):
            graph.replay()

    times = {(kind, n, T): [] for kind in ("step", "replay") for n, _ in variants for T in tokens}
    order = [n for n, _ in variants]
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            for T in tokens:
                times["step", name, T].append(median_ms(lambda: one(name, T), reps=args.reps))
                times["replay", name, T].append(median_ms(lambda: replays(name, T), reps=args.reps) / REPLAYS)
    rows = []
    for kind in ("step", "replay"):
        for T in tokens:
            ref = statistics.median(times[kind, order[0], T])
            for name, env in variants:
                got = times[kind, name, T]
                med = statistics.median(got)
                rows.append(dict(kind=kind, variant=name, env=env, T=T, median_ms=round(med, 4),
                                 over_first=round(med / ref, 4), rounds_ms=[round(t, 4) for t in got]))
                print(f"{kind:6s} T={T} {name:16s} {med:.4f} ms  x{med / ref:.3f}  rounds {min(got):.4f}-"
                      f"{max(got):.4f}", flush=True)
    kernels = []
    if args.profile:
        for name, _ in variants:
            for T in tokens:
                graph = next(g for key, g in graphs[name].graphs.items() if key[1] == T).graph
                table = kernel_table(graph.replay, top=14)
                kernels.append(dict(variant=name, T=T, **table))
                print(f"kernels T={T} {name}: {table['kernels']:.0f} per replay, {table['gpu_busy_us']:.1f} us busy",
                      flush=True)
                for k in table["top"]:
                    print(f"  {k['us']:8.1f} us  {k['calls']:5.1f}x  {k['name']}", flush=True)
    from eyas.kernels import tile_choice

    tiles = [dict(kernel=k[0], m=k[1], n=k[2], k=k[3], tile=dict(t.kwargs, num_warps=t.num_warps))
             for k, t in tile_choice.picked(lambda key: True)]
    for t in tiles:
        print("tile", json.dumps(t))
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape,
                   context=args.context, rounds=args.rounds, reps=args.reps, rows=rows, tiles=tiles, kernels=kernels),
              open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
