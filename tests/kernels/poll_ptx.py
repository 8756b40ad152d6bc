"""Compiles the persistent step's polls and a bare reduction for sm_90 offline (no GPU needed) and prints, as
JSON, what each PTX holds: run with TRITON_INTERPRET=0 (eyas.kernels.persistent_words reads it at import, and
an interpreted import compiles the CPU's stand-ins). tests/kernels/test_persistent_words.py reads it."""

import json
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from eyas.kernels.persistent_words import await_both, await_three

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from persistent_registers import split_polls  # noqa: E402  (benchmarks/persistent_registers.py)

REDUCTIONS = (8, 32, 64, 512)
POLLS_OF_TWO = ((512, 8), (32, 64), (64, 64), (512, 128))
POLLS_OF_THREE = ((512, 64, 16), (64, 64, 64))
UNVOTED = (32, 64)


@triton.jit
def _stale_count(words, out, ep, N: tl.constexpr):
    p = tl.load(words + tl.arange(0, N), volatile=True)
    tl.store(out, tl.max(((p >> 32) != ep).to(tl.int32)))


@triton.jit
def _poll_two(words, out, ep, N1: tl.constexpr, N2: tl.constexpr):
    a = tl.arange(0, N1)
    b = N1 + tl.arange(0, N2)
    x, y = await_both(words + a, a < N1, words + b, b < N1 + N2, ep.to(tl.int32), False)
    tl.store(out + a, x)
    tl.store(out + b, y)


@triton.jit
def _poll_three(words, out, ep, N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr):
    a = tl.arange(0, N1)
    b = N1 + tl.arange(0, N2)
    c = N1 + N2 + tl.arange(0, N3)
    x, y, z = await_three(words + a, a < N1, words + b, b < N1 + N2, words + c, c < N1 + N2 + N3,
                          ep.to(tl.int32), True)
    tl.store(out + a, x)
    tl.store(out + b, y)
    tl.store(out + c, z)


@triton.jit
def _poll_unvoted(words, out, ep, N: tl.constexpr):
    """A poll whose exit test is its own reduction, with no vote (the form persistent_words keeps for wide
    tensors)."""
    a = tl.arange(0, N)
    p = tl.load(words + a, volatile=True)
    while tl.max(((p >> 32) != ep).to(tl.int32)) > 0:
        p = tl.load(words + a, volatile=True)
    tl.store(out + a, p.to(tl.float32))


def ptx(kernel, out_type: str, **sizes) -> dict:
    sig = {"words": "*i64", "out": out_type, "ep": "i64", **{k: "constexpr" for k in sizes}}
    asm = triton.compile(ASTSource(kernel, sig, constexprs=sizes), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8}).asm
    seen = {k: k in asm["ptx"] for k in ("bar.sync", "st.shared", "bar.red.or.pred", "nanosleep")}
    return {**seen, "split polls": split_polls(asm["ttgir"])}


if __name__ == "__main__":
    out = {f"reduce {n}": ptx(_stale_count, "*i32", N=n) for n in REDUCTIONS}
    out.update({f"poll {a},{b}": ptx(_poll_two, "*fp32", N1=a, N2=b) for a, b in POLLS_OF_TWO})
    out.update({f"poll {a},{b},{c}": ptx(_poll_three, "*fp32", N1=a, N2=b, N3=c) for a, b, c in POLLS_OF_THREE})
    out.update({f"unvoted {n}": ptx(_poll_unvoted, "*fp32", N=n) for n in UNVOTED})
    print(json.dumps(out))
