"""The fused norm+linear and SiLU-and-mul+linear kernels against the two launches they replace, side by side.

For each projection of a model shape that the fusion touches (q/k/v and gate/up after a residual add and
RMSNorm, down after SiLU-and-mul, and the attention's output projection o as a plain GEMV) and each row
count, this times, as CUDA-graph replays (launch gaps included, as in a decode step), each call over its own
copy of the weights, enough copies to outgrow the L2 cache (as a step streams every layer's weights once):
  unfused: eyas.kernels.norm.add_rms_norm then F.linear (cuBLAS), or eyas.kernels.activation.silu_mul then F.linear,
           or F.linear alone
  fused:   eyas.kernels.fused_linear.norm_linear / silu_mul_linear / linear_rows
and prints µs per call, the weight bytes per µs, the largest difference between the two outputs, and the tile
the fused kernel's timing picked.

    python3 benchmarks/bench_fused_linear.py --shape smollm2 --rows 1,2 --out fused_linear.json

The kernels take at most MAX_K input features (wider projections, such as an 8B model's, stay with cuBLAS), so
the shapes are small models'. The copy bandwidth measured at the start puts the weight bytes per µs in proportion.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from bench_join import SMOLLM2
from bench_tp import copy_bandwidth
from eyas.engine.graphs import capture
from eyas.kernels.fused_linear import KERNEL_ROWS
from timing import median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

SHAPES = {"smollm2": SMOLLM2}
def graphed_us(fn, copies: list, reps: int = 20) -> float:
    """Median µs per call of fn(w), called once per weight copy in one CUDA graph (captured as the engine's
    are): the copies outgrow the L2 cache, so each call reads its weights from device memory, as in a step."""
    graph, _ = capture(lambda: [fn(w) for w in copies], pool=None)
    return median_ms(graph.replay, reps=reps, cuda=True) * 1e3 / len(copies)


def cases(shape: dict):
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * d
    return [("qkv", "norm", h, qkv), ("o", "plain", shape["num_attention_heads"] * d, h),
            ("gate_up", "norm", h, 2 * inter), ("down", "act", inter, h)]


def measure(name: str, kind: str, k: int, n: int, rows: int) -> dict:
    from eyas.kernels import fused_linear as fused
    from eyas.kernels.activation import silu_mul
    from eyas.kernels.norm import add_rms_norm
    from eyas.kernels.tile_choice import weight_copies

    g = torch.Generator(device="cuda").manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    w0 = (torch.randn(n, k, generator=g, device=dev) * k ** -0.5).to(dt)
    copies = weight_copies(w0)  # twice the L2 cache
    if kind == "norm":
        x, delta = (torch.randn(rows, k, generator=g, device=dev).to(dt) for _ in range(2))
        nw = (1 + 0.1 * torch.randn(k, generator=g, device=dev)).to(dt)

        def unfused(w):
            return F.linear(add_rms_norm(x, delta, nw, 1e-5)[1], w)

        def fused_fn(w):
            return fused.norm_linear(x, delta, nw, 1e-5, w)[1]
        kernel = fused._norm_linear_kernel
    elif kind == "plain":
        x = torch.randn(rows, k, generator=g, device=dev).to(dt)

        def unfused(w):
            return F.linear(x, w)

        def fused_fn(w):
            return fused.linear_rows(x, w)
        kernel = fused._norm_linear_kernel
    else:
        gate_up = (2 * torch.randn(rows, 2 * k, generator=g, device=dev)).to(dt)

        def unfused(w):
            return F.linear(silu_mul(gate_up), w)

        def fused_fn(w):
            return fused.silu_mul_linear(gate_up, w)
        kernel = fused._silu_mul_linear_kernel
    reference = unfused(w0).float()
    diff = (reference - fused_fn(w0).float()).abs().max().item()  # the first call also picks the tile
    t_unfused, t_fused = graphed_us(unfused, copies), graphed_us(fused_fn, copies)
    best = fused.tile_for(kernel.fn.__name__, rows, n, k)
    return dict(proj=name, k=k, n=n, rows=rows, copies=len(copies), unfused_us=round(t_unfused, 2),
                fused_us=round(t_fused, 2), speedup=round(t_unfused / t_fused, 3),
                weight_gb_s_fused=round(w0.numel() * 2 / 1e3 / t_fused, 1), max_abs_diff=diff,
                out_scale=reference.abs().max().item(),
                tile=dict(BLOCK_N=best.kwargs["BLOCK_N"], CHUNK_K=best.kwargs["CHUNK_K"], num_stages=best.num_stages,
                          num_warps=best.num_warps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--rows", default="1,2", help="tokens per call: decode steps of 1-2 sequences, a verify's 4-8")
    ap.add_argument("--out", default="bench_fused_linear.json")
    args = ap.parse_args()
    shapes = args.shape.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        sys.exit(f"error: --rows must be comma-separated integers, got {args.rows!r}")
    if unknown:
        sys.exit(f"error: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    if not all(1 <= r <= KERNEL_ROWS for r in rows):
        sys.exit(f"error: --rows must lie in 1..{KERNEL_ROWS} (the rows the fused kernels take)")
    if not torch.cuda.is_available():
        sys.exit("error: this benchmark times CUDA-graph replays and needs a CUDA GPU")
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_tb_s=copy_bandwidth() / 1e12,
               results=[])
    print(f"copy bandwidth {out['copy_bw_tb_s']:.2f} TB/s")
    print("| shape | proj | K | N | rows | unfused µs | fused µs | speedup | fused weight GB/s | tile |")
    for shape in shapes:
        for name, kind, k, n in cases(SHAPES[shape]):
            for r in rows:
                m = dict(shape=shape, **measure(name, kind, k, n, r))
                out["results"].append(m)
                print(f"| {shape} | {name} | {k} | {n} | {r} | {m['unfused_us']} | {m['fused_us']} | {m['speedup']} "
                      f"| {m['weight_gb_s_fused']} | {m['tile']} |", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
