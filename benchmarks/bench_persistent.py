"""The persistent decoder step (eyas.kernels.persistent_decode) vs eyas's CUDA-graph plain step, on SmolLM2-135M.

Usage: python benchmarks/bench_persistent.py [--random] [--dtype bf16|fp32] [--programs N] [--rows 1,2,4,8]
       [--context 100,500] [--tiles "engine;qkv,o,gu,down,lm;..."] [--warps 4,8] [--block-t 64,128] [--trace]
       [--kernel-only] [--device cpu --tiny]

In one child process (killed after --timeout seconds, so a deadlocked kernel ends with a message instead of
holding the GPU; a watching thread also ends it when any launch or timing loop runs past --deadline, naming
the launch's counters that had not reached their targets, read while it runs):
  (a) correctness: after a ~100-token prompt prefilled by eyas's engine path, the persistent step's logits vs
      eyas's plain forward at 1 and 4 rows (max abs diff, argmax equal), cache rows included;
  (b) timing (CUDA events, median of --reps): the persistent step, captured in a CUDA graph, at each of --rows
      rows after each of --context cached tokens vs eyas's own graphed decode step / verify forward of as many
      rows there (as bench_smollm2's phases time them), and the weight-read bound: weight bytes / measured
      device copy bandwidth;
  (c) with --trace, one traced launch of each at each --context: per op, how long items waited for their
      inputs, worked, and took to notice them after their last producer finished; and the step's critical
      path (the chain of items that set its length), summed per op: how many of its items waited for data
      and how many for their own program, and where its time went.
Each variant is a tile set x warps per program x the cache columns attention reads per block x the words'
format (--pairs). Prints markdown tables last.
--device cpu --tiny --random smoke-tests the script (W=1, Triton's interpreter).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
import time

from child_run import run_in_child  # benchmarks/child_run.py
from trace_cells import OP_HEADER, OP_RULE, PATH_HEADER, PATH_RULE, op_cells, path_cells  # benchmarks/

PROMPT = 100


def random_model(tiny: bool) -> str:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    from tests.helpers import smollm2_shaped_llama, tiny_llama

    path = tempfile.mkdtemp(prefix="eyas-bench-persistent-")
    if tiny:
        tiny_llama(path, vocab=256, layers=2, hidden=64, rope_theta=100000.0, tie_word_embeddings=True)
    else:
        smollm2_shaped_llama(path)
    return path


class LaunchWatch:
    """Ends the process with a clear message when GPU work runs past a deadline, from a thread of its own, so
    that a deadlocked launch is caught inside any call that waits for it (a timing loop's synchronize, an
    .item()), not only where the launch is polled. Sections are armed with `watching(what, step)`; past the
    deadline the step's counters are copied to the host on a side stream while the launch still runs, and those
    short of their targets are named (op and layer). The pinned buffer, stream and event are made beforehand by
    `register`, so that nothing is allocated on the device's behalf while a launch hangs."""

    def __init__(self, deadline_s: float, read=None, exit=os._exit, poll_s: float = 0.05):
        self.deadline_s, self.poll_s, self._exit = deadline_s, poll_s, exit
        self._read = read or self._read_mid_launch
        self._armed = None  # (what, step, armed at)
        self._hosts = {}
        self._closed = threading.Event()
        if read is None:
            import torch

            self._side, self._copied = torch.cuda.Stream(), torch.cuda.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def register(self, step):
        """Prepare to read `step`'s counters while one of its launches runs; returns the step."""
        if self._read == self._read_mid_launch:
            import torch

            self._hosts[id(step)] = torch.empty(step.counters.shape, dtype=step.counters.dtype, pin_memory=True)
        return step

    @contextlib.contextmanager
    def watching(self, what: str, step=None):
        self._armed = (what, step, time.monotonic())
        try:
            yield
        finally:
            self._armed = None

    def close(self) -> None:
        """Stop watching (the thread ends at its next poll)."""
        self._closed.set()

    def _run(self):
        while not self._closed.wait(self.poll_s):
            armed = self._armed
            if armed is not None and time.monotonic() - armed[2] > self.deadline_s:
                return self._fire(*armed[:2])

    def _fire(self, what: str, step) -> None:
        print(f"HANG: {what} did not finish within {self.deadline_s:.0f} s (a counter never reached its target); "
              "exiting", flush=True)
        counts = None if step is None else self._read(step)
        if counts is not None:
            print("HANG: short counters: " + ", ".join(step.short_counters(counts)), flush=True)
        self._exit(3)

    def _read_mid_launch(self, step, timeout_s: float = 5.0):
        """A host copy of a running launch's counters on the side stream (PyTorch's streams do not wait for
        the default stream), or None if the copy does not finish within timeout_s."""
        import torch

        host = self._hosts.get(id(step))
        if host is None:
            print("HANG: the step was not registered; its counters cannot be read while it runs", flush=True)
            return None
        with torch.cuda.stream(self._side):
            host.copy_(step.counters, non_blocking=True)
            self._copied.record(self._side)
        t0 = time.monotonic()
        while not self._copied.query():
            if time.monotonic() - t0 > timeout_s:
                print("HANG: the counters could not be read while the launch runs", flush=True)
                return None
            time.sleep(0.01)
        return host


def run(args) -> None:
    import torch

    from eyas.engine.engine import Engine
    from eyas.engine.persistent import target_tiles, target_warps
    from eyas.kernels.persistent_schedule import Tiles
    from eyas.kernels.persistent_step import PersistentStep, pack_llama
    from eyas.kernels.persistent_trace import critical_path, trace_summary

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import median_ms  # benchmarks/timing.py

    cuda = args.device == "cuda"
    if args.random:
        path = random_model(args.tiny)
    else:
        from eyas.models.demo import demo_model_path
        path = str(demo_model_path())
    dtype = args.dtype
    cached = max(PROMPT, *args.context)  # the prompt prefilled: each timed step reads its first `context` columns
    t0 = time.time()
    eng = Engine(path, dtype=dtype, device=args.device, max_batch=1, max_len=cached + 64)
    if cuda and not args.kernel_only:  # outside the launch watch: a hang here shows as the first line alone
        print("warming up the engine (its graphs and persistent steps)", flush=True)
        eng.warm_up()
    print(f"engine built{'' if args.kernel_only else ' and warmed up'} in {time.time() - t0:.1f} s", flush=True)
    model, runner, dev = eng.target, eng.runner, args.device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, cached), generator=g).to(dev)
    runner.prefill(prompt, [0])
    packed = pack_llama(model)
    element_size = next(model.parameters()).element_size()
    engine_tiles = target_tiles(model.config, element_size)
    if None in args.tiles and engine_tiles is None:
        raise SystemExit(f"bench_persistent: the engine takes no {dtype} pass of {path} through the kernel "
                         "(engine.persistent.target_tiles); name tiles with --tiles")
    args.tiles = [tuple(dataclasses.astuple(engine_tiles)[:5]) if t is None else t for t in args.tiles]
    args.warps = [target_warps(element_size) if w is None else w for w in args.warps]
    if args.tiny:  # head_dim 16, vocabulary 256
        args.tiles = [(min(t[0], 8), *t[1:4], min(t[4], 64)) for t in args.tiles]
    programs = args.programs or (torch.cuda.get_device_properties(0).multi_processor_count if cuda else 1)
    print(f"model {path} ({dtype}), prompt {PROMPT} tokens, programs {programs}", flush=True)
    variants = [(t, w, bt, p) for t in args.tiles for w in args.warps for bt in args.block_t for p in args.pairs]

    watch = LaunchWatch(args.deadline) if cuda else None

    def watching(what, step=None):
        return watch.watching(what, step) if cuda else contextlib.nullcontext()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def build(R, v, trace=False):
        step = PersistentStep(packed, R, programs, Tiles(*v[0]), block_t=v[2], num_warps=v[1], trace=trace,
                              pairs=v[3])
        return watch.register(step) if cuda else step

    steps = {(R, v): build(R, v) for R in sorted(set(args.rows) | {1, 4}) for v in variants}
    kv = runner.kv

    def plain(ids, R, at=PROMPT):
        pos = torch.arange(at, at + R, device=dev)[None]
        mask = None if R == 1 else torch.tril(torch.ones(R, R, dtype=torch.bool, device=dev))[None]
        return model.logits(runner.forward(ids, pos, [0], [at], new_mask=mask).hidden)[0]

    def persistent(ids, R, variant):
        return steps[R, variant](ids[0].to(torch.int32), PROMPT, kv.k, kv.v)

    rows_out = {}
    for R, v in [(R, v) for v in variants for R in (1, 4)]:  # (a) correctness
        ids = torch.randint(0, vocab, (1, R), generator=g).to(dev)
        k0, v0 = kv.k.clone(), kv.v.clone()
        want = plain(ids, R).float()
        k_want, v_want = kv.k.clone(), kv.v.clone()
        kv.k.copy_(k0)
        kv.v.copy_(v0)
        t0 = time.time()
        with watching(f"the first persistent launch of {R} rows ({v})", steps[R, v]):
            logits, tokens = persistent(ids, R, v)
            sync()
        print(f"R={R} {v}: compiled and launched in {time.time() - t0:.1f} s", flush=True)
        diff = (logits - want).abs().max().item()
        cache = max((kv.k - k_want).abs().max().item(), (kv.v - v_want).abs().max().item())
        same = bool(torch.equal(tokens, want.argmax(-1)))
        print(f"R={R} {v}: max |logits diff| {diff:.3e} (max |logit| {want.abs().max().item():.2f}), "
              f"cache diff {cache:.3e}, argmax equal {same}, counters complete "
              f"{steps[R, v].counters_complete()}", flush=True)
        rows_out[R, v] = dict(diff=diff, argmax=same)
        if args.repeat:  # a deterministic step gives the same bits at every launch on the same inputs
            first = logits.clone()
            with watching(f"a relaunch of {R} rows ({v})", steps[R, v]):
                second = persistent(ids, R, v)[0].clone()
                sync()
            k2, v2 = kv.k.clone(), kv.v.clone()
            # a new step's buffers (the same compiled kernel): does a first launch differ, or the process's first?
            fresh_step = build(R, v)
            with watching(f"a new step's first launch of {R} rows ({v})", fresh_step):
                fresh = fresh_step(ids[0].to(torch.int32), PROMPT, kv.k, kv.v)[0].clone()
                sync()
            other = torch.randint(0, vocab, (1, R), generator=g).to(dev)
            differ, worst = [0, 0], [0.0, 0.0]  # relaunches after the same inputs, after other inputs
            for i in range(args.repeat):
                with watching(f"relaunch {i + 1} of {R} rows ({v})", steps[R, v]):
                    if i % 2:
                        persistent(other, R, v)
                    d = (persistent(ids, R, v)[0] - second).abs().max().item()
                worst[i % 2] = max(worst[i % 2], d)
                differ[i % 2] += d != 0 or not torch.equal(kv.k, k2) or not torch.equal(kv.v, v2)
            print(f"R={R} {v}: max |logits diff| to the second launch: the first {(first - second).abs().max():.3e}, "
                  f"a new step's first {(fresh - second).abs().max():.3e}; relaunches that differ from it: "
                  f"{differ[0]} of {(args.repeat + 1) // 2} after the same inputs (max {worst[0]:.3e}), "
                  f"{differ[1]} of {args.repeat // 2} after other inputs (max {worst[1]:.3e})", flush=True)
            rows_out[R, v].update(relaunches_differing=sum(differ))

    # (b) timing
    def timed_step(ids, R, v, at):
        where = torch.tensor([at, 0], device=dev)
        inputs = (ids[0].contiguous(), where[0:1], where[1:2], torch.arange(R, device=dev),
                  torch.ones(R, R, dtype=torch.bool, device=dev).tril())
        launch = lambda: steps[R, v].launch(*inputs, kv.k, kv.v)  # noqa: E731
        if cuda:
            with watching(f"the persistent launch of {R} rows ({v}) at {at} cached tokens", steps[R, v]):
                launch()  # compiles for these inputs' types outside the graph's capture
                sync()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
            with watching(f"the graphed persistent step of {R} rows ({v}) at {at} cached tokens", steps[R, v]):
                graph.replay()
                sync()
            launch = graph.replay
        with watching(f"the timed persistent steps of {R} rows ({v}) at {at} cached tokens", steps[R, v]):
            ms = median_ms(launch, reps=args.reps, cuda=cuda)
        if not steps[R, v].counters_complete():
            print(f"R={R} {v}: counters did not reach the schedule's totals", flush=True)
        return ms

    table = []
    for at in args.context:
        for R in args.rows:
            ids = torch.randint(0, vocab, (1, R), generator=g).to(dev)
            ours = [timed_step(ids, R, v, at) for v in variants]
            theirs = None if args.kernel_only else median_ms(lambda: plain(ids, R, at), reps=args.reps, cuda=cuda)
            table.append((at, R, ours, theirs))
            print(f"context {at}, R={R}: persistent {', '.join(f'{t:.4f}' for t in ours)} ms, eyas "
                  + ("not timed" if theirs is None else f"{theirs:.4f} ms"), flush=True)

    weights = sum(t.numel() * t.element_size() for t in (packed.attn_norm, packed.wqkv, packed.wo, packed.mlp_norm,
                                                          packed.w_gate_up, packed.w_down, packed.final_norm,
                                                          packed.lm_head))
    bound = None
    if cuda:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src), reps=20, cuda=True)
        bandwidth = 2 * src.numel() / (copy_ms * 1e-3)  # bytes read + written per second
        bound = weights / bandwidth * 1e3
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, weights {weights / 1e6:.1f} MB", flush=True)
    name = lambda v: (f"tiles {','.join(map(str, v[0]))}, {v[1]} warps, {v[2]}-column blocks"  # noqa: E731
                      + {None: "", True: ", pairs", False: ", one value a word"}[v[3]])
    print("\n| cached tokens | rows | variant | persistent ms | eyas forward ms (its CUDA graph where it has one) "
          "| eyas / persistent | weight-read bound ms |\n| ---: | --- | --- | --- | --- | --- | --- |")
    b = f"{bound:.4f}" if bound is not None else "n/a (cpu)"
    for at, R, ours, theirs in table:
        for v, t in zip(variants, ours):
            eyas = ("n/a", "n/a") if theirs is None else (f"{theirs:.4f}", f"{theirs / t:.2f}x")
            print(f"| {at} | {R} | {name(v)} | {t:.4f} | {eyas[0]} | {eyas[1]} | {b} |")
    print("\n| rows | variant | max abs logits diff | argmax equal |\n| --- | --- | --- | --- |")
    for (R, v), r in rows_out.items():
        print(f"| {R} | {name(v)} | {r['diff']:.3e} | {r['argmax']} |")
    if args.trace:
        print(f"\n| cached tokens | rows | variant | {OP_HEADER} |\n| ---: | --- | --- | {OP_RULE} |")
        paths = []
        for R in args.rows:
            ids = torch.randint(0, vocab, (1, R), generator=g).to(dev)
            for v in variants:
                traced = build(R, v, trace=True)
                for at in args.context:
                    for _ in range(3):  # the first launch compiles; the last one is read
                        with watching(f"the traced launch of {R} rows ({v}) at {at} cached tokens", traced):
                            traced(ids[0].to(torch.int32), at, kv.k, kv.v)
                            sync()
                    for op in trace_summary(traced.schedule, traced.trace):
                        print(f"| {at} | {R} | {name(v)} | {op_cells(op)} |")
                    paths.append((at, R, v, critical_path(traced.schedule, traced.trace, traced.programs)))
        print(f"\n| cached tokens | rows | variant | {PATH_HEADER} |\n| ---: | --- | --- | {PATH_RULE} |")
        for at, R, v, path in paths:
            for op in path:
                print(f"| {at} | {R} | {name(v)} | {path_cells(op)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--random", action="store_true", help="random weights of SmolLM2's shape")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="the target's dtype (default: bf16 on cuda; the CPU runs fp32 only)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (with --random; CPU smoke test)")
    ap.add_argument("--programs", type=int, default=0, help="persistent programs (default: the SM count; 1 on cpu)")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", default=str(PROMPT), help="cached tokens before each timed step, comma-separated")
    ap.add_argument("--tiles", default="engine",
                    help="';'-separated tile sets, each 'engine' (engine.persistent.target_tiles' choice for the "
                         "dtype) or the rows per item of qkv (each half of a rotation pair), o_proj, gate_up, down "
                         "and lm_head (small tiles spread each stage over every SM)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--kernel-only", action="store_true", help="time the persistent variants alone: eyas's step "
                    "is not timed, so its graphs are not warmed up (about 70 s on an H100)")
    ap.add_argument("--warps", default="engine", help="warps per program, comma-separated, or 'engine' "
                    "(engine.persistent.target_warps' choice for the weights' dtype)")
    ap.add_argument("--pairs", default="", help="comma-separated 0 / 1: one value a word, or bf16 pairs "
                    "(persistent_decode); default persistent_step.pairs_by_default decides per row count")
    ap.add_argument("--block-t", default="128", help="cache columns per attention block, comma-separated")
    ap.add_argument("--repeat", type=int, default=0, help="relaunch each checked step N times on the same "
                    "inputs, every other one after a launch on other inputs, and count launches that differ")
    ap.add_argument("--trace", action="store_true", help="time each item's wait and work with %%globaltimer (GPU)")
    ap.add_argument("--deadline", type=float, default=60.0,
                    help="seconds a launch (with its compile) or a timing loop may take")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds before the child is killed")
    args = ap.parse_args()
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
        args.context = [int(c) for c in args.context.split(",")]
    except ValueError:
        ap.error("--rows and --context take comma-separated integers")
    if not all(1 <= r <= 8 for r in args.rows):
        ap.error("--rows: the persistent step serves 1 to 8 rows")
    longest = 448 if args.tiny else 1984  # the random models' positions (512, 2048) less a verify's rows
    if not all(1 <= c <= longest for c in args.context):
        ap.error(f"--context: 1 to {longest} cached tokens")
    try:
        args.tiles = [None if ts == "engine" else tuple(int(t) for t in ts.split(",")) for ts in args.tiles.split(";")]
    except ValueError:
        ap.error(f"--tiles takes 'engine' or ';'-separated sets of comma-separated integers, got {args.tiles!r}")
    if any(t is not None and (len(t) != 5 or min(t) < 1) for t in args.tiles):
        ap.error("each --tiles set is 'engine' or five positive integers: qkv,o_proj,gate_up,down,lm_head")
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cpu" and args.dtype != "fp32":
        ap.error("--device cpu runs --dtype fp32 only")
    try:
        args.warps = [None if w == "engine" else int(w) for w in args.warps.split(",")]
    except ValueError:
        ap.error(f"--warps takes 'engine' or comma-separated integers, got {args.warps!r}")
    if args.pairs and not set(args.pairs.split(",")) <= {"0", "1"}:
        ap.error("--pairs takes comma-separated 0 and 1")
    args.pairs = [p == "1" for p in args.pairs.split(",")] if args.pairs else [None]
    try:
        args.block_t = [int(b) for b in args.block_t.split(",")]
    except ValueError:
        ap.error("--block-t takes comma-separated integers")
    if not all(b >= 16 and b & (b - 1) == 0 for b in args.block_t):
        ap.error("--block-t: powers of two of at least 16 (a tensor-core product's depth)")
    if args.device == "cpu":
        if args.trace:
            ap.error("--trace reads the GPU's %globaltimer: it needs --device cuda")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.reps = min(args.reps, 3)
    run_in_child(run, args, args.timeout)


if __name__ == "__main__":
    main()
