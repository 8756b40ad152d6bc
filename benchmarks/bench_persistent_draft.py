"""A chain's draft step as one persistent launch (eyas.engine.persistent_draft) against the per-op draft step it
replaces, on SmolLM2's shape (random target weights) with an EAGLE-3 draft.

Usage: python3 benchmarks/bench_persistent_draft.py [--draft assets/smollm2-135m-eagle3|random] [--context 100,300]
       [--tiles "engine;8,16,32,8,64"] [--warps 4,8] [--reps 200] [--trace] [--device cpu --tiny]

In one child process (killed after --timeout seconds, so a deadlocked kernel ends with a message):
  (a) correctness: over a draft cache the draft itself filled, one draft step both ways from the same cache
      (the kernel's with each --tiles set): the argmax, the output state (the next step's hidden input) and
      the cache's new row;
  (b) timing (CUDA events, median of --reps, each path captured in a CUDA graph as the engine runs it): the
      draft step at each --context cached columns, the kernel's with each tile set, and the per-op step;
  (c) with --trace, one traced launch at each --context: per op, how long items waited, worked and took to
      notice their inputs, and the step's critical path summed per op (eyas.kernels.persistent_trace).
--device cpu --tiny --draft random smoke-tests the script (one program, Triton's interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from child_run import run_in_child  # benchmarks/child_run.py
from trace_cells import OP_HEADER, OP_RULE, PATH_HEADER, PATH_RULE, op_cells, path_cells  # benchmarks/


def run(args) -> None:
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # benchmarks/ and the repository (tests.helpers)
    from timing import median_ms  # benchmarks/timing.py

    from eyas.config import ModelConfig, SpecConfig
    from eyas.engine.engine import Engine
    from eyas.engine.persistent_draft import LM_BLOCK
    from eyas.kernels.persistent_schedule import Tiles
    from eyas.kernels.persistent_step import PersistentStep
    from eyas.kernels.persistent_trace import critical_path, trace_summary
    from eyas.layers.topk import argmax
    from tests.helpers import random_draft, smollm2_shaped_llama, tiny_llama

    cuda = args.device == "cuda"
    path = tempfile.mkdtemp(prefix="eyas-bench-persistent-draft-")
    if args.tiny:  # three layers: a draft reads the target's layers 2, L//2 and L-3
        tiny_llama(path, vocab=256, layers=3, hidden=64)
    else:
        smollm2_shaped_llama(path)
    cfg = ModelConfig.from_dir(path)
    draft = args.draft
    if draft == "random":
        draft = random_draft(cfg.hidden_size, cfg.vocab_size, draft_vocab=min(8192, cfg.vocab_size), seed=0,
                             head_dim=cfg.head_dim)
    cached = max(args.context)
    eng = Engine(path, dtype="bf16" if cuda else "fp32", device=args.device, max_batch=1, max_len=cached + 8,
                 draft=draft, spec=SpecConfig(3, 1, adaptive=False))
    drafter = eng.decoder.drafter
    pd = drafter.persistent
    if pd is None or pd.packed is None:
        raise SystemExit("bench_persistent_draft: the engine takes no draft step through the kernel here (the draft's "
                         "shape, or the plan's persistent_draft)")
    dev, H, kv = torch.device(args.device), drafter.draft.config.hidden_size, drafter.kv
    g = torch.Generator().manual_seed(0)
    slots, kv_len = torch.zeros(1, dtype=torch.long, device=dev), kv.max_len
    vocab = drafter.draft.config.draft_vocab_size
    with torch.no_grad():  # the draft fills its own cache's first `cached` columns
        ids = torch.randint(0, vocab, (1, cached), generator=g).to(dev)
        hidden = torch.randn(1, cached, H, generator=g).to(dev, kv.k.dtype)
        drafter.forward(drafter.draft.embed_ids(ids, drafter.embed), hidden, torch.arange(cached, device=dev)[None],
                        slots, torch.zeros(1, dtype=torch.long, device=dev), kv_len)
    programs = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 1
    variants = [(pd.tiles if t is None else Tiles(*t), w) for t in args.tiles for w in args.warps]
    steps = [PersistentStep(pd.packed, 1, programs, t, block_l=LM_BLOCK, num_warps=w) for t, w in variants]
    tiles_name = lambda t: ",".join(map(str, (t.qkv, t.o_proj, t.gate_up, t.down, t.lm_head)))  # noqa: E731
    name = lambda v: tiles_name(v[0]) + ("" if args.warps == [8] else f", {v[1]} warps")  # noqa: E731
    print(f"target {path}, draft {args.draft} (the engine's tiles {tiles_name(pd.tiles)}), {cached} columns cached, "
          f"{programs} programs", flush=True)

    ids = torch.randint(0, vocab, (1, 1), generator=g).to(dev)
    hidden = torch.randn(1, 1, H, generator=g).to(dev, kv.k.dtype)
    starts = {at: torch.tensor([at], device=dev) for at in args.context}

    def per_op(at):
        start = starts[at]
        out = drafter.forward(drafter.draft.embed_ids(ids, drafter.embed), hidden, start[:, None], slots, start,
                              kv_len)
        return argmax(drafter.draft.head_output(out)), out

    def kernel(step, at):  # as the engine's chain launches a draft step
        return pd.launch(step, ids, hidden, starts[at], slots)

    # (a) correctness, from the same cache
    at = args.context[0]
    k0, v0 = kv.k.clone(), kv.v.clone()
    with torch.no_grad():
        want_ids, want_out = (t.clone() for t in per_op(at))
        k_want, v_want = kv.k.clone(), kv.v.clone()
        for v, step in zip(variants, steps):
            kv.k.copy_(k0)
            kv.v.copy_(v0)
            got_ids, got_out = (t.clone() for t in kernel(step, at))
            out_diff = (got_out.float() - want_out.float()).abs().max().item()
            cache_diff = max((kv.k - k_want).abs().max().item(), (kv.v - v_want).abs().max().item())
            print(f"tiles {name(v)}: argmax equal {bool(torch.equal(got_ids, want_ids))}, max |output diff| "
                  f"{out_diff:.3e} (max |output| {want_out.float().abs().max().item():.2f}), cache diff "
                  f"{cache_diff:.3e}, counters complete {step.counters_complete()}", flush=True)

    # (b) timing, each path graphed as the engine captures it
    def timed(fn):
        if not cuda:
            return median_ms(fn, reps=args.reps, cuda=False)
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay, reps=args.reps, cuda=True)

    table = []
    with torch.no_grad():
        for at in args.context:
            ours = [timed(lambda: kernel(step, at)) for step in steps]
            theirs = timed(lambda: per_op(at))
            table.append((at, ours, theirs))
            print(f"{at} cached columns: persistent {', '.join(f'{t:.4f}' for t in ours)} ms, per-op {theirs:.4f} ms",
                  flush=True)
    print("\n| cached columns | tiles | persistent draft step ms | per-op draft step ms | per-op / persistent |\n"
          "| ---: | --- | ---: | ---: | ---: |")
    for at, ours, theirs in table:
        for v, t in zip(variants, ours):
            print(f"| {at} | {name(v)} | {t:.4f} | {theirs:.4f} | {theirs / t:.2f}x |")

    if args.trace:  # (c)
        print(f"\n| cached columns | tiles | {OP_HEADER} |\n| ---: | --- | {OP_RULE} |")
        paths = []
        for v in variants:
            traced = PersistentStep(pd.packed, 1, programs, v[0], block_l=LM_BLOCK, num_warps=v[1], trace=True)
            for at in args.context:
                for _ in range(3):  # the first launch compiles; the last one is read
                    traced(ids[0].to(torch.int32), at, kv.k, kv.v, slot=0, hidden=hidden[0].contiguous())
                    torch.cuda.synchronize()
                for op in trace_summary(traced.schedule, traced.trace):
                    print(f"| {at} | {name(v)} | {op_cells(op)} |")
                paths.append((at, v, critical_path(traced.schedule, traced.trace, traced.programs)))
        print(f"\n| cached columns | tiles | {PATH_HEADER} |\n| ---: | --- | {PATH_RULE} |")
        for at, v, path in paths:
            for op in path:
                print(f"| {at} | {name(v)} | {path_cells(op)} |")


def fail(message: str):
    print(f"bench_persistent_draft: error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--draft", default="assets/smollm2-135m-eagle3", help="an EAGLE-3 draft for SmolLM2's shape, "
                    "or 'random'")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target (with --draft random; CPU smoke test)")
    ap.add_argument("--context", default="100,300", help="cached draft columns before each timed step, "
                    "comma-separated")
    ap.add_argument("--tiles", default="engine", help="';'-separated tile sets, each the rows per item of qkv, "
                    "o_proj, gate_up, down and lm_head, or 'engine' (persistent_draft.draft_tiles' choice)")
    ap.add_argument("--warps", default="8", help="warps per program, comma-separated (the engine launches 8)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--trace", action="store_true", help="time each item's wait and work with %%globaltimer (GPU)")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds before the child is killed")
    args = ap.parse_args()
    try:
        args.context = [int(c) for c in args.context.split(",")]
    except ValueError:
        fail("--context takes comma-separated integers")
    longest = 448 if args.tiny else 504  # the kernel's draft steps read at most 512 columns
    if not all(1 <= c <= longest for c in args.context):
        fail(f"--context: 1 to {longest} cached columns")
    try:
        args.warps = [int(w) for w in args.warps.split(",")]
    except ValueError:
        fail("--warps takes comma-separated integers")
    if not all(w in (1, 2, 4, 8, 16) for w in args.warps):
        fail("--warps: powers of two from 1 to 16")
    if args.reps < 1:
        fail("--reps must be at least 1")
    try:
        args.tiles = [None if ts == "engine" else tuple(int(t) for t in ts.split(",")) for ts in args.tiles.split(";")]
    except ValueError:
        fail(f"--tiles takes 'engine' or ';'-separated sets of comma-separated integers, got {args.tiles!r}")
    if any(t is not None and (len(t) != 5 or min(t) < 1) for t in args.tiles):
        fail("each --tiles set is five positive integers: qkv,o_proj,gate_up,down,lm_head")
    if args.tiny and args.draft != "random":
        fail("--tiny takes --draft random (a trained draft has SmolLM2's shape)")
    if args.draft != "random" and not os.path.isdir(args.draft):
        fail(f"no draft directory {args.draft}")
    if args.device == "cpu":
        if args.trace:
            fail("--trace reads the GPU's %globaltimer: it needs --device cuda")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("EYAS_KERNELS", "force")
        args.reps = min(args.reps, 3)
    run_in_child(run, args, args.timeout)


if __name__ == "__main__":
    main()
