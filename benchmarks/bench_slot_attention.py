"""The slot-attention kernel at batch 1, per call, for every split count side by side with the one the engine picks.

A decode step at batch 1 launches the attention once per layer with B * kv_heads * row-blocks programs:
3 for SmolLM2 (3 kv heads), 8 for an 8B Llama. Cutting each row's columns into `splits` pieces gives more
programs (flash-decoding) at the price of a merge. This times, for each model shape, query count T
(1 = decode, 4 / 8 = a verify), cached column count and split count, one call per layer replayed from a
CUDA graph (each layer its own cache, as in a step), in µs per call; `picked` is what
eyas.kernels.attention_splits.choose_splits gives for the bound a graph would be captured with.

    python3 benchmarks/bench_slot_attention.py --shape smollm2,llama-8b --out slot_attention.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_join import SMOLLM2
from bench_tp import LLAMA_8B
from eyas import execution_plan
from eyas.engine.graphs import capture, kernel_kv_len
from eyas.kernels.attention_splits import choose_splits
from eyas.kernels.slot_attention import slot_attention
from timing import median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

SHAPES = {"smollm2": SMOLLM2, "llama-8b": LLAMA_8B}
MAX_LEN = 2048


def graph_bound(columns: int) -> int:
    """The kv_len a decode graph is captured with for rows of this length (eyas.engine.graphs.graph_kv_len)."""
    return kernel_kv_len(columns, MAX_LEN)


def time_calls(shape: dict, T: int, columns: int, splits: int | None, reps: int, block_n: int) -> float:
    """µs per attention call: one call per layer, each over its own cache, replayed from one CUDA graph."""
    layers, heads, kv_heads = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
    D = shape["hidden_size"] // heads
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    caches = [(torch.randn(1, kv_heads, MAX_LEN, D, generator=g, device=dev, dtype=dt),
               torch.randn(1, kv_heads, MAX_LEN, D, generator=g, device=dev, dtype=dt)) for _ in range(layers)]
    q = torch.randn(1, T, heads, D, generator=g, device=dev, dtype=dt)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    starts = torch.full((1,), columns - T, dtype=torch.long, device=dev)
    bound = graph_bound(columns)

    def step():
        return [slot_attention(q, k, v, slots, starts, D ** -0.5, kv_len=bound, splits=splits,
                               block_n=block_n) for k, v in caches]

    graph, _ = capture(step, pool=None)
    return median_ms(graph.replay, reps=reps, cuda=True) * 1e3 / layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2,llama-8b")
    ap.add_argument("--tokens", default="1,4,8", help="query tokens per call (1: decode)")
    ap.add_argument("--columns", default="128,320,512,1024,2000", help="cached columns each row attends over")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--block-n", default="64", help="cache columns per loop step (slot_attention's block_n), each in turn")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="slot_attention.json")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch "
                    "(execution plan: pdl=False)")
    args = ap.parse_args()
    for name in ("tokens", "columns", "splits", "block_n"):
        try:
            values = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise SystemExit(f"bench_slot_attention: --{name.replace('_', '-')} {getattr(args, name)!r} is not a "
                             "comma-separated list of positive counts")
    rows = []
    with execution_plan.using(pdl=not args.no_pdl):
        for block_n in args.block_n.split(","):
            rows += measure_shapes(args, int(block_n))
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, pdl=not args.no_pdl,
                   rows=rows), open(args.out, "w"), indent=2)


def measure_shapes(args, block_n: int) -> list[dict]:
    rows = []
    for name in args.shape.split(","):
        if name not in SHAPES:
            raise SystemExit(f"bench_slot_attention: unknown shape {name!r} (have {', '.join(SHAPES)})")
        shape = SHAPES[name]
        kv_heads = shape["num_key_value_heads"]
        G = shape["num_attention_heads"] // kv_heads
        for T in map(int, args.tokens.split(",")):
            for columns in map(int, args.columns.split(",")):
                if columns > MAX_LEN or columns <= T:
                    continue
                m_blocks = -(-T * G // 64)
                picked = choose_splits(kv_heads * m_blocks, graph_bound(columns))
                per_split = {}
                for s in sorted({*map(int, args.splits.split(",")), picked}):
                    try:
                        per_split[s] = time_calls(shape, T, columns, s, args.reps, block_n)
                    except Exception as e:  # e.g. a tile past the shared memory: a row says so, the rest runs
                        print(f"{name} T={T} columns={columns} splits={s} block_n={block_n}: {str(e)[:120]}")
                if not per_split:
                    continue
                picked_us = per_split.get(picked)
                best = min(per_split, key=per_split.get)
                row = dict(shape=name, block_n=block_n, T=T, columns=columns, picked=picked, picked_us=picked_us,
                           best=best, best_us=per_split[best], us={str(s): round(u, 2) for s, u in per_split.items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
