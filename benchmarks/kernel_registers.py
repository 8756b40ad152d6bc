"""Registers and spills per thread of the fused projection's tiles, compiled for sm_90a without a GPU.

Usage: python benchmarks/kernel_registers.py [--rows 1,4,8] [--k 576] [--out registers.json]

For each row count and each tile the warm-up may time (eyas.kernels.fused_linear.CONFIGS, after its
pruning), compiles the fused norm + projection (K input features, SmolLM2's q/k/v and gate/up by default)
with Triton for compute capability 9.0 and runs Triton's own ptxas with --verbose on the PTX. A tile that
spills, or needs so many registers that few warps fit on a multiprocessor, is unlikely to win the timing.
These are the compiler's counts, not timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from eyas.kernels import fused_linear  # noqa: E402


def ptxas_path() -> str:
    """The ptxas Triton itself compiles sm_90 with (it knows which of the ones it carries reads its PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def counts(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        p = subprocess.run([str(ptxas_path()), "-arch=sm_90a", "--verbose", str(src), "-o", str(Path(tmp) / "k.o")],
                           capture_output=True, text=True)
    text = p.stdout + p.stderr
    if p.returncode:
        raise RuntimeError(f"ptxas failed: {text[-500:]}")
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs[1]) if regs else None, "spill_store_bytes": int(spill[1]) if spill else 0}


def tile_counts(rows: int, k: int, config) -> dict:
    block_m, block_k = triton.next_power_of_2(rows), triton.next_power_of_2(k)
    kernel = fused_linear._norm_linear_kernel
    constexprs = dict(HAS_NORM=True, HAS_DELTA=True, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_K=block_k, USE_PDL=False,
                      **config.kwargs)
    sig = {p.name: "constexpr" if p.is_constexpr else ("fp32" if p.name == "eps" else
                                                       "*bf16" if p.name.endswith("_ptr") else "i32")
           for p in kernel.params}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps})
    return {"rows": rows, "k": k, **config.kwargs, "num_warps": config.num_warps, **counts(compiled.asm["ptx"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        print(f"kernel_registers: error: --rows must be comma-separated integers, got {args.rows!r}", file=sys.stderr)
        return 2
    if not all(1 <= r <= fused_linear.KERNEL_ROWS for r in rows) or not 1 <= args.k <= fused_linear.MAX_K:
        print(f"kernel_registers: error: rows must lie in 1..{fused_linear.KERNEL_ROWS} and --k in "
              f"1..{fused_linear.MAX_K}", file=sys.stderr)
        return 2
    results = []
    print("| rows | BLOCK_N | CHUNK_K | warps | registers | spill bytes |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        for config in fused_linear._prune(fused_linear.CONFIGS, {"M": r, "K": args.k}):
            c = tile_counts(r, args.k, config)
            results.append(c)
            print(f"| {r} | {c['BLOCK_N']} | {c['CHUNK_K'] or 'whole'} | {c['num_warps']} | {c['registers']} "
                  f"| {c['spill_store_bytes']} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
