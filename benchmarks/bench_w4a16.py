"""The W4A16 kernel (eyas.kernels.w4a16) against the dequantized bf16 path, on Kimi-K2's layer shapes at decode.

Usage: python3 benchmarks/bench_w4a16.py --rows 1,16 --out w4a16.json      (needs a CUDA GPU)

Random weights of Kimi-K2's shapes (hidden 7168; 384 routed experts of width 2048, 8 per token; one shared
expert; 64 heads of 128 values into o_proj; q_lora 1536 into q_b_proj), packed as compressed-tensors int4 with
group 32 and bf16 scales. For each projection and each row count this times, as CUDA-graph replays (launch
gaps included, as in a decode step):
  bf16:  the dense weights eyas held before (F.linear on cuBLAS; for the routed experts, the grouped matmul
         that models/moe.Experts runs over token copies sorted by expert)
  int4:  the kernel on the packed weights (dense rows; for the routed experts, one row per token copy, each
         naming its expert)
Dense projections cycle through enough weight copies to outgrow the L2 cache; routed experts cycle through
8 random routings. It prints µs per call, the speedup, the packed bytes read per µs beside the device's copy
bandwidth (the ceiling), and the largest difference between the kernel and the layer's torch reference.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from eyas.kernels.w4a16 import quant_linear_rows
from eyas.layers.quant_linear import QuantFormat, reference_matmul
from eyas.models.moe import GROUPED_MM
from timing import median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

KIMI = dict(hidden=7168, experts=384, top_k=8, expert_inter=2048, heads=64, v_head=128, q_lora=1536, qk_head=192)
FMT = QuantFormat("int4", 32)
L2_BYTES = 2 * 60 * 1024 ** 2  # copies of a dense weight fill twice this (an H200's L2 is 60 MiB)


def cases(s: dict) -> list[tuple[str, int, int, int]]:
    """(name, K, N, experts): experts 0 for a dense projection."""
    return [("q_b_proj", s["q_lora"], s["heads"] * s["qk_head"], 0),
            ("o_proj", s["heads"] * s["v_head"], s["hidden"], 0),
            ("shared gate_up", s["hidden"], 2 * s["expert_inter"], 0),
            ("shared down", s["expert_inter"], s["hidden"], 0),
            ("experts gate_up", s["hidden"], 2 * s["expert_inter"], s["experts"]),
            ("experts down", s["expert_inter"], s["hidden"], s["experts"])]


def random_packed(lead: tuple, n: int, k: int, g: torch.Generator):
    """Random int4 words and bf16 scales of [*lead, n, k] weights (any bits are valid values)."""
    words = torch.randint(-2 ** 31, 2 ** 31, (*lead, n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    scale = (torch.rand(*lead, n, k // 32, device="cuda", generator=g) * 0.01 + 0.001).to(torch.bfloat16)
    return words, scale


def graphed_us(calls: list, reps: int = 20) -> float:
    """Median µs per call of the callables, all replayed in one CUDA graph (compiled and warmed up first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return median_ms(graph.replay, reps=reps, cuda=True) * 1e3 / len(calls)


def measure_dense(k: int, n: int, rows: int, g: torch.Generator) -> dict:
    packed_bytes = n * k // 2 + n * k // 32 * 2
    copies = max(1, -(-L2_BYTES // packed_bytes))
    packed = [random_packed((), n, k, g) for _ in range(copies)]
    dense = [FMT.dequantize(w, s, None, k, torch.bfloat16) for w, s in packed]
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    t_bf16 = graphed_us([lambda w=w: F.linear(x, w) for w in dense])
    t_int4 = graphed_us([lambda w=w, s=s: quant_linear_rows(x, FMT, w, s) for w, s in packed])
    want = reference_matmul(x, FMT, *packed[0], None, k).float()
    diff = (quant_linear_rows(x, FMT, *packed[0]).float() - want).abs().max().item()
    return dict(copies=copies, bf16_us=t_bf16, int4_us=t_int4, bytes_read=packed_bytes, max_abs_diff=diff,
                out_scale=want.abs().max().item())


def measure_experts(k: int, n: int, experts: int, rows: int, top_k: int, g: torch.Generator) -> dict:
    words, scale = random_packed((experts,), n, k, g)
    dense = torch.stack([FMT.dequantize(words[e], scale[e], None, k, torch.bfloat16) for e in range(experts)])
    x = torch.randn(rows * top_k, k, device="cuda", generator=g).to(torch.bfloat16)  # one row per token copy
    routings = [torch.stack([torch.randperm(experts, device="cuda", generator=g)[:top_k] for _ in range(rows)])
                .flatten().to(torch.int32) for _ in range(8)]

    def grouped(ids):
        order = ids.argsort(stable=True)
        ends = torch.searchsorted(ids[order], torch.arange(experts, device="cuda", dtype=torch.int32),
                                  right=True).to(torch.int32)
        return GROUPED_MM(x[order], dense.transpose(1, 2), offs=ends)

    t_bf16 = graphed_us([lambda ids=ids: grouped(ids) for ids in routings])
    t_int4 = graphed_us([lambda ids=ids: quant_linear_rows(x, FMT, words, scale, expert_ids=ids) for ids in routings])
    ids = routings[0]
    got = quant_linear_rows(x, FMT, words, scale, expert_ids=ids).float()
    want = torch.stack([reference_matmul(x[r], FMT, words[e], scale[e], None, k).float()
                        for r, e in enumerate(ids.tolist())])
    chosen = len(set(ids.tolist()))
    return dict(copies=len(routings), bf16_us=t_bf16, int4_us=t_int4, bytes_read=chosen * (n * k // 2 + n * k // 16),
                max_abs_diff=(got - want).abs().max().item(), out_scale=want.abs().max().item())


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16", help="tokens per call, comma-separated, each in 1..16 (decode)")
    ap.add_argument("--out", default="bench_w4a16.json")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        fail(f"--rows must be comma-separated integers, got {args.rows!r}")
    if not all(1 <= r <= 16 for r in rows):
        fail("--rows must lie in 1..16 (the decode shapes the kernel is for)")
    if not torch.cuda.is_available():
        fail("this benchmark times CUDA-graph replays and needs a CUDA GPU")
    if GROUPED_MM is None:
        fail(f"torch {torch.__version__} has no grouped matmul for the bf16 experts path")
    from bench_tp import copy_bandwidth

    g = torch.Generator(device="cuda").manual_seed(0)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_tb_s=copy_bandwidth() / 1e12,
               shape=KIMI, results=[])
    print(f"{out['gpu']}: copy bandwidth {out['copy_bw_tb_s']:.2f} TB/s")
    print("| proj | K | N | rows | bf16 µs | int4 µs | speedup | int4 packed GB/s | max abs diff / output scale |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, k, n, experts in cases(KIMI):
        for r in rows:
            m = (measure_experts(k, n, experts, r, KIMI["top_k"], g) if experts else measure_dense(k, n, r, g))
            m = dict(proj=name, k=k, n=n, rows=r, **m, speedup=m["bf16_us"] / m["int4_us"],
                     int4_gb_s=m["bytes_read"] / 1e3 / m["int4_us"])
            out["results"].append(m)
            print(f"| {name} | {k} | {n} | {r} | {m['bf16_us']:.1f} | {m['int4_us']:.1f} | {m['speedup']:.2f} "
                  f"| {m['int4_gb_s']:.0f} | {m['max_abs_diff']:.2e} / {m['out_scale']:.2e} |", flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
