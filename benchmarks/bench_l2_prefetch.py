"""Does an L2 prefetch make the projection after it faster? One GEMV of a batch-1 row, timed alone with CUDA
events, after the L2 cache was flushed (a read of 1 GiB) and after the flush and a prefetch of the
weight (eyas.kernels.l2_prefetch) and a ~50 µs pause. Also the prefetch's own time.

    python3 benchmarks/bench_l2_prefetch.py --shape llama-8b --out l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from eyas.kernels.l2_prefetch import MODES, prefetch_l2

SHAPES = {  # name: (hidden, {projection: (outputs, inputs)})
    "llama-8b": {"o": (4096, 4096), "qkv": (6144, 4096), "gate_up_part": (2048, 4096)},
    "smollm2": {"o": (576, 576), "qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)},
}


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0  # µs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama-8b")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--chunks", default="16384,65536", help="bulk prefetch sizes in bytes")
    ap.add_argument("--out", default="l2_prefetch.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_l2_prefetch: needs a CUDA GPU")
    flush = torch.ones(2 ** 28, dtype=torch.float32, device="cuda")  # 1 GiB, well over L2
    rows = []
    for name, (n, k) in SHAPES[args.shape].items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        settings = [("none", None, 0)] + [("bulk", "bulk", int(c)) for c in args.chunks.split(",")]
        settings.append(("lines", "lines", 128))
        for label, mode, chunk in settings:
            gemv, fetch = [], []
            for _ in range(args.reps + 3):
                flush.sum()  # a read: evicts L2 without leaving dirty lines to write back
                torch.cuda.synchronize()
                if mode is not None:
                    fetch.append(timed(lambda: prefetch_l2(w, None, mode, chunk)))
                torch.cuda._sleep(100_000)  # ~50 µs: a bulk prefetch may still be reading when its kernel ends
                gemv.append(timed(lambda: F.linear(x, w)))
            gemv, fetch = gemv[3:], fetch[3:]
            row = {"projection": name, "shape": [n, k], "mode": label, "chunk": chunk,
                   "gemv_us": round(statistics.median(gemv), 2),
                   "prefetch_us": round(statistics.median(fetch), 2) if fetch else None,
                   "gemv_tb_s": round(w.numel() * 2 / statistics.median(gemv) / 1e6, 3)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "modes": list(MODES), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
