"""Registers, spills, barriers and instructions of the persistent decoder step, compiled for sm_90a without a GPU.

Usage: python benchmarks/persistent_registers.py [--rows 1,4,8] [--warps 4,8] [--tiles 16,16,16,16,384] [--trace]
       [--block-t 128] [--pairs 0,1] [--draft]

Compiles eyas.kernels.persistent_decode's kernel for SmolLM2-135M's shape in bf16 with the three EAGLE-3 features
written (the constexprs PersistentStep passes, and the divisibility the JIT infers from an engine launch's
arguments) with Triton for compute capability 9.0, and runs Triton's own ptxas with --verbose on the PTX. One
program per SM must fit: warps x 32 x registers at most 65,536, and a spill costs local-memory traffic inside every
item. A column says whether the PTX sleeps between poll rounds (a 1-row step's do), one how many polls end on a
reduction that Triton keeps within each warp (they can split the program's warps: must be 0); the last two count,
per op, the barriers (BAR.SYNC in the SASS, from Triton's nvdisasm) and the instructions between an item's last
poll load and its end, in branches taken or not and loop bodies once: every cross-warp reduction and layout change
through shared memory costs one or two barriers, and the item's work after its inputs arrive waits on each in
turn; the last says whether the step passes bf16 word pairs (by default as the engine's steps do,
persistent_step.pairs_by_default; --pairs compiles each row count in the formats named). --draft compiles the
draft form instead, for the bundled SmolLM2 draft's midlayer (its tiles by default as the engine takes them,
engine.persistent_draft.draft_tiles). These are the compiler's counts, not timings.
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
from eyas.kernels.persistent_step import kernel_constants, pairs_by_default  # noqa: E402
from eyas.kernels.persistent_words import WARP_REDUCED  # noqa: E402

SMOLLM2 = DecoderShape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30, vocab=49152)
# The bundled draft's midlayer (assets/smollm2-135m-eagle3), its tiles as engine.persistent_draft.draft_tiles gives
DRAFT = DecoderShape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=2816, layers=1, vocab=8192)
DRAFT_TILES = "8,16,16,8,64"
FP32 = {"logits", "cos", "sin", "eps", "scale"}
I32_POINTERS = {"table", "counters", "epoch", "capture"}
I64_POINTERS = {"ids", "d2t", "tokens", "start", "slot_of", "depth", "trace",  # and the words items pass each other
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
        elif p.name in ("embed", "hidden_in", "hidden_norm_w", "attn_norm_w", "wqkv", "wo", "mlp_norm_w", "wgu",
                        "wd", "final_norm_w", "lm_head", "k_cache", "v_cache", "features"):
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


def compile_step(rows: int, warps: int, tiles: Tiles, trace: bool, block_t: int = 128,
                 pairs: bool | None = None, draft: bool = False) -> dict:
    shape = DRAFT if draft else SMOLLM2
    if pairs is None:  # as the engine's steps take them
        pairs = pairs_by_default(shape, torch.bfloat16, rows, tiles)
    captured = 1 if draft else 3  # a draft's step writes its output state; a target's the three features
    constexprs = kernel_constants(shape, rows, tiles, captured, 32, block_t, torch.bfloat16, trace, pairs, draft)
    kernel = persistent_decode.persistent_step_kernel
    sig = signature(kernel, constexprs)
    t0 = time.time()
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=divisibility(sig)),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    return {"rows": rows, "warps": warps, "trace": trace, "pairs": pairs, "compile_s": time.time() - t0,
            "naps": "nanosleep" in ptx,
            "split_polls": split_polls(compiled.asm["ttgir"]), "after_poll": after_poll(sass(compiled.asm["cubin"])),
            **counts(ptx)}


def split_polls(ttgir: str) -> int:
    """Poll loops whose exit test (an scf.while's condition region) reduces at most WARP_REDUCED values: Triton
    reduces those within each warp, so the program's warps may leave the loop in different rounds
    (eyas.kernels.persistent_words). A voting poll tests a vote carried from its body, with no reduction in its
    condition."""
    found, inside, small = 0, False, False
    for line in ttgir.splitlines():
        if "scf.while" in line:
            inside, small = True, False
        elif inside and "scf.condition" in line:
            found, inside = found + small, False
        elif inside and (m := re.search(r"\}\) : \(tensor<(\d+)xi\d+", line)):
            small = small or int(m[1]) <= WARP_REDUCED.value
    return found


def sass(cubin: bytes) -> str:
    """The cubin's SASS, from the nvdisasm Triton finds as it finds its ptxas (triton.tools.disasm's cuobjdump
    drops the jump table's targets that after_poll reads)."""
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


def after_poll(code: str) -> dict[str, list[str]] | None:
    """Per op, the SASS lines from its item's last poll load (a volatile load: LDG ... STRONG) to the next op's
    code, in layout order. The item loop dispatches on the op code through one jump table whose targets are in op
    order; the argmax is its default, the target of the bounds check's branch before it, and the ops' code ends
    where the branches join, the label before the completion's atomic add and its one-thread guard (code laid
    out past it is not an op's). None if the compiler laid the dispatch out otherwise."""
    lines = code.splitlines()
    jumps = [(i, re.search(r'BRANCH_TARGETS ([^"]*)"', line)) for i, line in enumerate(lines)]
    jumps = [(i, m) for i, m in jumps if m]
    if len(jumps) != 1:
        return None
    at, table = jumps[0]
    targets = table[1].split(",")
    guarded = (re.search(r"@!?P\d BRA `\((\.L_x_\d+)\)", line) for line in reversed(lines[:at]))
    default = next((m[1] for m in guarded if m), None)
    targets = targets + [default] if default else targets
    ops = persistent_decode.OPS[:len(targets)]
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    adds = [i for i, line in enumerate(lines) if i > at and "REDG.E.ADD" in line]
    if any(t not in labels for t in targets) or not adds or len(ops) != len(targets):
        return None
    guard = max([i for i in range(at, adds[0]) if "BSSY" in lines[i]], default=adds[0])
    join = max((i for i in labels.values() if i < guard), default=0)
    bounds = sorted(labels[t] for t in targets)
    if bounds[-1] > join:
        return None
    ends = dict(zip(bounds, bounds[1:] + [join]))  # to the next op's code, the last to the join
    out = {}
    for op, target in zip(ops, targets):
        region = lines[labels[target]:ends[labels[target]]]
        polls = [j for j, line in enumerate(region) if "LDG" in line and "STRONG" in line]
        out[op] = region[polls[-1] if polls else 0:]
    return out


def instructions(region: list[str]) -> int:
    """SASS instructions among the lines (each carries its address as a /*hex*/ comment)."""
    return sum(bool(re.match(r"\s*/\*[0-9a-f]+\*/\s+\S", line)) for line in region)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--tiles", default="", help="qkv, o_proj, gate_up, down, lm_head (default 16,16,16,16,384; "
                    f"with --draft {DRAFT_TILES})")
    ap.add_argument("--draft", action="store_true", help="the draft form, for the bundled draft's shape")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--block-t", type=int, default=128, help="cache columns per attention block (the engine's 128)")
    ap.add_argument("--pairs", default="", help="comma-separated 0 / 1: one value a word, bf16 word pairs "
                    "(default: as the engine's steps take them)")
    args = ap.parse_args(argv)
    try:
        formats = [{"0": False, "1": True}[p] for p in args.pairs.split(",")] if args.pairs else [None]
        rows = [int(r) for r in args.rows.split(",")]
        warps = [int(w) for w in args.warps.split(",")]
        sizes = [int(t) for t in (args.tiles or (DRAFT_TILES if args.draft else "16,16,16,16,384")).split(",")]
        if len(sizes) != 5:
            raise ValueError
        tiles = Tiles(*sizes)
    except (KeyError, ValueError):
        print("persistent_registers: error: --rows, --warps and --tiles take comma-separated integers "
              "(--tiles five of them), --pairs comma-separated 0 and 1", file=sys.stderr)
        return 2
    ops = " / ".join(persistent_decode.OPS)
    print("| rows | warps | trace | registers | spill bytes | fits one program per SM | compile s | block_t "
          f"| polls nap | polls that split the warps | barriers after the poll ({ops}) "
          f"| instructions after the poll ({ops}) | word pairs |")
    print("| ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | --- | --- | --- |")
    for r, w, pairs in ((r, w, p) for r in rows for w in warps for p in formats):
        c = compile_step(r, w, tiles, args.trace, args.block_t, pairs, args.draft)
        fits = w * 32 * (c["registers"] or 0) <= 65536
        bars = ins = "not found"
        if c["after_poll"]:
            regions = c["after_poll"].values()
            bars = " / ".join(str(sum("BAR.SYNC" in line for line in v)) for v in regions)
            ins = " / ".join(str(instructions(v)) for v in regions)
        print(f"| {r} | {w} | {args.trace} | {c['registers']} | {c['spill_store_bytes']} | {fits} "
              f"| {c['compile_s']:.1f} | {args.block_t} | {c['naps']} | {c['split_polls']} | {bars} | {ins} "
              f"| {c['pairs']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
