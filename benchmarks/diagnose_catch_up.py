"""What the draft's catch-up compiles the first time a batch of B sequences catches up over L pairs (CUDA).

On an H200 a speculative window of the adaptive policy took ~1 s where its neighbours took
~20 ms, all of it in the catch-up pass (benchmarks/bench_smollm2.py --sections scaling, its slowest
windows): something compiled mid-traffic. This script warms an engine up as a server does, then for each
(B, L) runs L plain steps and one speculative cycle, and prints the cycle's time, every Triton compilation
and every tile choice it made. A tiny random target and draft (no download); the kernels' specializations
do not depend on the weights.

    python3 benchmarks/diagnose_catch_up.py --shapes 1x5,2x3,4x7,5x9,8x16,8x16,13x33
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the tiny random models


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x5,2x3,4x7,5x9,8x16,8x16,13x33,16x2,16x2",
                    help="BxL: sequences that catch up together, and the plain steps before (their lag)")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        raise SystemExit(f"diagnose_catch_up: --shapes {args.shapes!r} is not a list of BxL") from None
    if not torch.cuda.is_available():
        raise SystemExit("diagnose_catch_up: needs a CUDA device")
    import triton.runtime.jit as jit

    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.kernels import tile_choice
    from eyas.layers.sampling import SamplingParams
    from tests.helpers import random_draft, tiny_llama

    compiled = []
    if hasattr(jit.JITFunction, "_do_compile"):
        real = jit.JITFunction._do_compile

        def logged(self, *a, **kw):
            t = time.perf_counter()
            out = real(self, *a, **kw)
            compiled.append(f"{self.fn.__name__} {time.perf_counter() - t:.2f}s")
            return out
        jit.JITFunction._do_compile = logged
    else:
        print("this Triton has no JITFunction._do_compile: compilations are not listed")

    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(tmp, vocab=256, layers=5, hidden=128)
        eng = Engine(tmp, dtype="bf16", device="cuda", max_batch=16, max_len=1024,
                     draft=random_draft(128, 256, head_dim=32), spec=SpecConfig(3, 1, adaptive=True))
        eng.warm_up()
        policy = eng.decoder.policy
        for B, L in shapes:
            for _ in range(B):
                eng.add(list(range(3, 40)), SamplingParams(max_tokens=L + 12, ignore_eos=True))
            policy.forced = False  # plain steps: each leaves a pair for the draft to catch up on
            for _ in range(L):
                eng.step()
            policy.forced = True
            n_compiled, n_tiles = len(compiled), len(list(tile_choice.picked(lambda key: True)))
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()  # the catch-up, then one speculative cycle
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) * 1e3
            tiles = len(list(tile_choice.picked(lambda key: True))) - n_tiles
            print(f"B={B:2d} L={L:2d}: {ms:8.1f} ms, tiles chosen {tiles}, compiled {compiled[n_compiled:]}", flush=True)
            policy.forced = None
            while eng.has_work():
                eng.step()


if __name__ == "__main__":
    main()
