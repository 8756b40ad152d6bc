"""One speculative cycle at batch 1 on a random-weight SmolLM2-shaped target: what a cycle costs does not depend
on what the weights say, so no model file has to reach the GPU machine. Per chain 3/1/4 and tree 5/4/8 (or each
setting of --specs): wall ms per cycle as the engine runs it (ahead of the host), CUDA kernels, graph launches
and GPU busy time per cycle under torch.profiler with the kernels that take the most time, and the eyas
profiler's per-phase times (those run in step with the host, through the phase graphs). The acceptance of a
random target is near 1: compare cycles, not tokens/s.

    python3 benchmarks/bench_cycle_graph.py --draft assets/smollm2-135m-eagle3 --context 300 --out cycle_graph.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import bench_smollm2 as bench
from bench_join import random_smollm2


def report(name: str, row: dict, top: int = 30):
    """A row as one JSON line without its kernel list, then its `top` kernels by time per cycle."""
    print(json.dumps({"row": name, **{k: v for k, v in row.items() if k != "kernels_by_name"}}), flush=True)
    for k in row["kernels_by_name"][:top]:
        print(f"  {k['us']:8.1f} us  {k['calls']:6.1f}x  {k['name']}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="assets/smollm2-135m-eagle3",
                    help="an EAGLE-3 draft for SmolLM2's shape, or 'random'")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before the first cycle")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--twin", default="", help="also each row with FIELD=VALUE[,FIELD=VALUE...] set: execution "
                    "plan fields (e.g. topk_kernel=0)")
    ap.add_argument("--specs", default="", help="settings as steps/topk[/draft tokens], comma-separated (default: "
                    "chain 3/1/4 and tree 5/4/8)")
    ap.add_argument("--out", default="cycle_graph.json")
    args = ap.parse_args()
    if args.context < 1 or args.cycles < 1:
        raise SystemExit("bench_cycle_graph: --context and --cycles must be at least 1")
    twin = bench.parse_twin(args.twin)
    specs = bench.parse_specs(args.specs)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_cycle_graph: no CUDA device (the cycle graphs need one; --device cpu times the "
                         "torch reference path)")
    if args.draft != "random" and not Path(args.draft).is_dir():
        raise SystemExit(f"bench_cycle_graph: no draft directory {args.draft}")
    bench.DEVICE = args.device
    with tempfile.TemporaryDirectory() as tmp:
        model = random_smollm2(Path(tmp))
        draft = bench.draft_arg(args, model)
        prompt = [(7 * i + 11) % 49000 + 100 for i in range(args.context)]
        rows = bench.cycle_profiles(model, prompt, draft, cycles=args.cycles, report=report, twin=twin, specs=specs)
    result = dict(gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                  context=args.context, cycles=args.cycles, draft=args.draft, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
