"""A decode step's GEMVs, weight stored two ways, side by side: does any of them read at the copy bandwidth?

For each projection of a model shape (q/k/v, o, gate/up, down, the LM head) and row count, this times, as
CUDA-graph replays each over its own weight copy (twice the L2 cache in all, as a step streams every layer's
weights once; benchmarks/bench_fused_linear.py's method):
  nk        F.linear(x, w), w [N, K] as the layers store it (cuBLAS; the backend torch prefers)
  nk-lt     the same with torch's preferred BLAS library set to cuBLASLt, nk-cublas to cuBLAS
  kn        x @ wt, wt [K, N] contiguous (cuBLAS, torch's preference)
  kn-tri    eyas.kernels.gemv_kn over wt [K, N]: every tile of the sweep (--quick: fewer), the fastest shown
and prints µs per call and the weight bytes per µs, and the sum over one step of an 8B model's layers.

    python3 benchmarks/bench_gemv.py --shape llama-8b --rows 1,4 --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton

from bench_join import SMOLLM2
from bench_tp import LLAMA_8B, copy_bandwidth
from eyas.engine.graphs import capture
from timing import median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

SHAPES = {"smollm2": SMOLLM2, "llama-8b": LLAMA_8B}
TILES = dict(block_n=(128, 256, 512), block_k=(8, 16, 32), num_warps=(4, 8), split=(1, 2, 4, 8, 16))
QUICK_TILES = dict(block_n=(256, 512), block_k=(16,), num_warps=(4, 8), split=(1, 4, 8))


def graphed_us(fn, copies: list, reps: int = 20) -> float:
    """Median µs per call of fn(w), once per weight copy in one CUDA graph."""
    graph, _ = capture(lambda: [fn(w) for w in copies], pool=None)
    return median_ms(graph.replay, reps=reps, cuda=True) * 1e3 / len(copies)


def projections(shape: dict) -> list[tuple[str, int, int, int]]:
    """(name, K, N, per step) of each projection a decode step runs."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * d
    return [("qkv", h, qkv, layers), ("o", shape["num_attention_heads"] * d, h, layers),
            ("gate_up", h, 2 * inter, layers), ("down", inter, h, layers), ("lm_head", h, shape["vocab_size"], 1)]


def with_blas(library: str | None, fn):
    """fn run with torch's preferred BLAS library set to `library` (None: as it is), restored after."""
    def run(*args):
        before = torch.backends.cuda.preferred_blas_library()
        if library:
            torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn(*args)
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return run


def measure(name: str, k: int, n: int, rows: int, tiles: dict) -> dict:
    from eyas.kernels.gemv_kn import gemv_kn
    from eyas.kernels.tile_choice import weight_copies

    g = torch.Generator(device="cuda").manual_seed(0)
    w0 = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    copies_nk = weight_copies(w0)
    copies_kn = [w.t().contiguous() for w in copies_nk]
    ref = F.linear(x, w0).float()
    times = {}
    for label, lib in (("nk", None), ("nk-cublas", "cublas"), ("nk-lt", "cublaslt")):
        times[label] = with_blas(lib, lambda: graphed_us(lambda w: F.linear(x, w), copies_nk))()
    times["kn"] = graphed_us(lambda wt: x @ wt, copies_kn)
    best, err = None, None
    blocks = [dict(zip(tiles, values)) for values in itertools.product(*tiles.values())]
    for tile in blocks:
        programs = -(-n // tile["block_n"]) * tile["split"]
        held = triton.next_power_of_2(rows) * tile["block_k"] * tile["block_n"] / (32 * tile["num_warps"])
        if not 64 <= programs <= 4096 or tile["split"] * tile["block_k"] > k or held > 128:
            continue  # too few or too many programs, or an accumulator that spills
        y = gemv_kn(x, copies_kn[0], **tile)
        e = (y.float() - ref).abs().max().item()
        us = graphed_us(lambda wt, tile=tile: gemv_kn(x, wt, **tile), copies_kn)
        if best is None or us < best[0]:
            best, err = (us, tile), e
    times["kn-tri"] = best[0]
    weight_bytes = w0.numel() * 2
    return dict(proj=name, k=k, n=n, rows=rows, copies=len(copies_nk), us={a: round(b, 2) for a, b in times.items()},
                tb_s={a: round(weight_bytes / b / 1e6, 2) for a, b in times.items()}, tile=best[1],
                tri_max_abs_diff=err, out_scale=ref.abs().max().item())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-8b", help=f"one of {sorted(SHAPES)}")
    ap.add_argument("--rows", default="1", help="comma-separated tokens per call (1: a decode step at batch 1)")
    ap.add_argument("--quick", action="store_true", help="sweep fewer Triton tiles")
    ap.add_argument("--out", default="bench_gemv.json")
    args = ap.parse_args()
    if args.shape not in SHAPES:
        sys.exit(f"error: unknown shape {args.shape!r}; choose from {sorted(SHAPES)}")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        sys.exit(f"error: --rows must be comma-separated integers, got {args.rows!r}")
    if not all(1 <= r <= 16 for r in rows):
        sys.exit("error: --rows must lie in 1..16")
    if not torch.cuda.is_available():
        sys.exit("error: this benchmark times CUDA-graph replays and needs a CUDA GPU")
    bw = copy_bandwidth()
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_tb_s=bw / 1e12, results=[],
               blas_default=str(torch.backends.cuda.preferred_blas_library()))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; torch prefers {out['blas_default']}")
    variants = ("nk", "nk-cublas", "nk-lt", "kn", "kn-tri")
    print("| proj | K | N | rows | " + " | ".join(f"{v} µs (TB/s)" for v in variants) + " | kn-tri tile |")
    step = {r: {v: 0.0 for v in variants} for r in rows}
    for name, k, n, per_step in projections(SHAPES[args.shape]):
        for r in rows:
            m = measure(name, k, n, r, QUICK_TILES if args.quick else TILES)
            out["results"].append(m)
            for v in variants:
                step[r][v] += per_step * m["us"][v]
            print(f"| {name} | {k} | {n} | {r} | " + " | ".join(f"{m['us'][v]} ({m['tb_s'][v]})" for v in variants)
                  + f" | {m['tile']} |", flush=True)
    for r in rows:
        print(f"one step's projections, {r} row(s), µs: " + ", ".join(f"{v} {step[r][v]:.0f}" for v in variants))
    out["step_us"] = step
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
