"""Registers, spills and barriers of the persistent decoder step, compiled for sm_90a without a GPU.

Usage: python benchmarks/persistent_registers.py [--rows 1,4,8] [--warps 4,8] [--tiles 16,16,16,16,384] [--trace]
       [--block-t 128]

Compiles eyas.kernels.persistent_decode's kernel for SmolLM2-135M's shape in bf16 with the three EAGLE-3 features
written (the constexprs PersistentStep passes, and the divisibility the JIT infers from an engine launch's
arguments) with Triton for compute capability 9.0, and runs Triton's own ptxas with --verbose on the PTX. One
program per SM must fit: warps x 32 x registers at most 65,536, and a spill costs local-memory traffic inside every
item. A column says whether the PTX sleeps between poll rounds (a 1-row step's do); the last counts, per op, the
barriers (BAR.SYNC in the SASS, from Triton's nvdisasm) between an item's last poll load and its end,
in branches taken or not: every cross-warp reduction and layout change through shared memory costs one or two,
and the item's work after its inputs arrive waits on each in turn. These are the compiler's counts, not timings.
Exits non-zero if a kernel does not compile (Triton's interpreter, which the CPU tests run,
accepts some programs the compiler rejects).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_registers import counts  # noqa: E402  (benchmarks/kernel_registers.py)

from eyas.kernels import persistent_decode  # noqa: E402
from eyas.kernels.persistent_schedule import DecoderShape, Tiles  # noqa: E402
from eyas.kernels.persistent_step import kernel_constants  # noqa: E402

SMOLLM2 = DecoderShape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30, vocab=49152)
FP32 = {"logits", "cos", "sin", "eps", "scale"}
I32_POINTERS = {"table", "counters", "epoch", "capture"}
I64_POINTERS = {"ids", "tokens", "start", "slot_of", "depth", "trace",  # and the words items pass each other
                "h_buf", "q_buf", "kv_new", "attn_buf", "act_buf", "tile_max", "tile_arg"}


def signature(kernel, constexprs: dict) -> dict:
    sig = {}
    for p in kernel.params:
        if p.name in constexprs:
            sig[p.name] = "constexpr"
        elif p.name in FP32:
            sig[p.name] = "fp32" if p.name in ("eps", "scale") else "*fp32"
        elif p.name in I32_POINTERS or p.name in I64_POINTERS:
            sig[p.name] = "*i32" if p.name in I32_POINTERS else "*i64"
        elif p.name == "row_mask":
            sig[p.name] = "*i1"
        elif p.name in ("embed", "attn_norm_w", "wqkv", "wo", "mlp_norm_w", "wgu", "wd", "final_norm_w", "lm_head",
                        "k_cache", "v_cache", "features"):
            sig[p.name] = "*bf16"
        else:
            sig[p.name] = "i32"
    return sig


# The integer arguments that are multiples of 16 when the engine launches the step for SmolLM2 (the widths and
# the KV cache's strides); Triton's JIT marks those, and every pointer (torch allocations are 16-byte aligned),
# as divisible by 16, which lets it vectorize loads: the offline compile is told the same.
MULTIPLES_OF_16 = {"c_layer", "c_slot", "c_head", "c_pos", "H", "I", "V", "n_lm_tiles"}


def divisibility(sig: dict) -> dict:
    """ASTSource attrs: what the JIT's specialization would say of these arguments at an engine launch."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
            if kind.startswith("*") or name in MULTIPLES_OF_16}


def compile_step(rows: int, warps: int, tiles: Tiles, trace: bool, block_t: int = 128) -> dict:
    constexprs = kernel_constants(SMOLLM2, rows, tiles, 3, 32, block_t, torch.bfloat16, trace)
    kernel = persistent_decode.persistent_step_kernel
    sig = signature(kernel, constexprs)
    t0 = time.time()
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=divisibility(sig)),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    return {"rows": rows, "warps": warps, "trace": trace, "compile_s": time.time() - t0, "naps": "nanosleep" in ptx,
            "barriers": poll_barriers(sass(compiled.asm["cubin"])), **counts(ptx)}


def sass(cubin: bytes) -> str:
    """The cubin's SASS, from the nvdisasm Triton finds as it finds its ptxas (triton.tools.disasm's cuobjdump
    drops the jump table's targets that poll_barriers reads)."""
    from triton import knobs

    tool = knobs.nvidia.nvdisasm.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        p = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"nvdisasm failed: {p.stderr[-500:]}")
    return p.stdout


def poll_barriers(code: str) -> dict[str, int] | None:
    """Per op, the BAR.SYNCs between its item's last poll load (a volatile load: LDG ... STRONG) and the next op's
    code. The item loop dispatches on the op code through one jump table whose targets are in op order (the
    argmax falls through to the default); None if the compiler laid the dispatch out otherwise."""
    lines = code.splitlines()
    table = [re.search(r'BRANCH_TARGETS ([^"]*)"', line) for line in lines]
    table = [m for m in table if m]
    if len(table) != 1:
        return None
    targets = table[0][1].split(",")
    ops = persistent_decode.OPS[:len(targets)]
    starts = {}
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L_x_\d+):", line)
        if label and label[1] in targets:
            starts[label[1]] = i
    if len(starts) != len(targets):
        return None
    ends = dict(zip(sorted(starts.values()), sorted(starts.values())[1:] + [len(lines)]))  # to the next op's code
    out = {}
    for op, target in zip(ops, targets):
        region = lines[starts[target]:ends[starts[target]]]
        polls = [j for j, line in enumerate(region) if "LDG" in line and "STRONG" in line]
        out[op] = sum("BAR.SYNC" in line for line in region[polls[-1] if polls else 0:])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--tiles", default="16,16,16,16,384", help="qkv, o_proj, gate_up, down, lm_head")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--block-t", type=int, default=128, help="cache columns per attention block (the engine's 128)")
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        warps = [int(w) for w in args.warps.split(",")]
        sizes = [int(t) for t in args.tiles.split(",")]
        if len(sizes) != 5:
            raise ValueError
        tiles = Tiles(*sizes)
    except ValueError:
        print("persistent_registers: error: --rows, --warps and --tiles take comma-separated integers "
              "(--tiles five of them)", file=sys.stderr)
        return 2
    print("| rows | warps | trace | registers | spill bytes | fits one program per SM | compile s | block_t "
          f"| polls nap | barriers after the poll ({' / '.join(persistent_decode.OPS[:6])}) |")
    print("| ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- | --- |")
    for r in rows:
        for w in warps:
            c = compile_step(r, w, tiles, args.trace, args.block_t)
            fits = w * 32 * (c["registers"] or 0) <= 65536
            print(f"| {r} | {w} | {args.trace} | {c['registers']} | {c['spill_store_bytes']} | {fits} "
                  f"| {c['compile_s']:.1f} | {args.block_t} | {c['naps']} "
                  f"| {' / '.join(map(str, c['barriers'].values())) if c['barriers'] else 'not found'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
