"""SmolLM2-135M on one GPU: eyas plain vs eyas EAGLE-3 vs HF transformers, phase costs, and losslessness.

Usage: python benchmarks/bench_smollm2.py --draft DIR|random --out results.json [--prompts 10] [--lossless 80] [--sections speed,phases,lossless,bf16,accept]

Sections, all in one process so the numbers are side by side:
  speed      batch-1 greedy decode of 256 new tokens on MT-bench prompts: eyas plain, eyas + draft (chain 3/1/4
             and tree 5/4/8), HF `generate` with a static cache, HF prompt-lookup decoding (bf16; HF runs in
             a child process, each prompt once untimed first so that its compilation is not timed); eyas
             plain and chain again with the plan's fused_linear off, built after the first two; with --also-specs, a
             row per listed setting and plain once more, built last
  phases     one target decode step vs a verify pass of 4 and 8 tokens vs one draft step (CUDA events)
  lossless   fp32 (TF32 off): speculative greedy == plain greedy on the MT-bench first turns, chain and tree;
             with --twin, plain, chain and tree with the twin's settings too, one prompt at a time
  bf16       share of identical outputs in bf16; every divergence's top-2 logit gap in the plain run (twins too)
  accept     acceptance length on the 80 MT-bench first turns and the 164 HumanEval prompts (bf16, greedy, stop at EOS)
  cycle      one speculative cycle at batch 1 under torch.profiler: CUDA kernels, graph launches and eager kernel
             launches per cycle, host wall time, GPU busy time, and the eyas profiler's per-phase GPU times
  scaling    tokens/s at batch 1, 8, 32, 64 (--batches): plain, chain 3/1/4 always, chain with the adaptive policy,
             the three engines built first, then timed in --rounds rounds of alternating order (the median);
             the smallest batch from which always speculating is slower than plain
  sweep      batch-1 tokens/s and acceptance of each speculative setting in --specs (steps/topk[/draft tokens],
             SGLang's meaning) beside plain decode on the same prompts, every engine built first, then timed in
             --rounds rounds of alternating order: which chain and which tree are fastest

With --markdown FILE the speed, cycle, scaling and sweep sections are also written there as markdown tables under a
line naming the date, hardware, versions, commit and command (benchmarks/md_tables.py), rewritten as rows
arrive, for docs/BENCHMARKS.md to take as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from eyas.bench.datasets import load_prompts
from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.profile import Profiler
from eyas.errors import EyasError
from eyas.layers.sampling import SamplingParams
from eyas.models.demo import demo_model_path
from eyas.models.tokenizer import encode_messages, load_tokenizer
from ablation import ablated  # benchmarks/ablation.py
from md_tables import ratio, run_header, table, writable  # benchmarks/md_tables.py
from timing import kernels_by_name, median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

CHAIN, TREE = SpecConfig(3, 1, adaptive=False), SpecConfig(5, 4, 8, adaptive=False)  # every step speculates
SWEEP_SPECS = "2/1,3/1,4/1,5/1,6/1,7/1,3/2/4,4/2/6,5/2/8,4/4/8,5/4/8,6/4/8,6/4/12,8/4/12,6/8/16"
DEVICE = "cuda"  # --device cpu runs the same code slowly, as a smoke test of the script itself
NEW_TOKENS = 256  # per request, as the issues measure (MT-bench, HumanEval); --new-tokens changes it


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts_ids(tok, n):
    return [encode_messages(tok, p.messages) for p in load_prompts("mt-bench")[:n]]


def draft_arg(args, model_path):
    if args.draft != "random":
        return args.draft
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, whatever the working directory
    from tests.helpers import random_draft
    from eyas.config import ModelConfig
    cfg = ModelConfig.from_dir(model_path)
    return random_draft(cfg.hidden_size, cfg.vocab_size, draft_vocab=8192)


# The attention's short rows in one pass and cuBLAS for SmolLM2's output projection: the decode step without
# those two fusions, for --old-step rows beside the default's.
OLD_STEP = ("short_row_splits", "0", "fused_o_proj", "0")  # execution plan fields (ablation.py)
IN_STEP = ("decode_ahead", "0")  # the host in step with the GPU, one step at a time


def eyas_engine(model_path, dtype, warm_prompt, draft=None, spec=None):
    """An engine for one sequence, warmed up (its CUDA graphs captured) on a short generation."""
    eng = Engine(str(model_path), dtype=dtype, device=DEVICE, draft=draft, spec=spec, max_batch=1, max_len=2048)
    eng.generate([warm_prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    return eng


def timed_run(eng, prompts, new_tokens=None):
    """Tokens/s of the prompts one after another (batch 1, ignore EOS), the verify passes, and a digest of
    the tokens (rows of one run that must decode alike compare it)."""
    params = SamplingParams(max_tokens=new_tokens or NEW_TOKENS, ignore_eos=True)
    toks, secs, passes = 0, 0.0, 0
    digest = hashlib.sha1()
    for p in prompts:
        sync()
        t0 = time.perf_counter()
        [s] = eng.generate([p], params)
        sync()
        secs += time.perf_counter() - t0
        toks += len(s.output_ids)
        passes += s.verify_passes
        digest.update(repr(s.output_ids).encode())
    return dict(tok_s=toks / secs, tokens=toks, seconds=secs, passes=passes, digest=digest.hexdigest())


def cycle_phases(eng, prompt, new_tokens=None):
    """The eyas profiler's summary over one more generation: a separate pass, since its CUDA events cost
    host time that the timed runs must not pay. A profiled engine runs in step with the host, through the
    phase graphs (draft, verify, commit) that cycles ahead of it never replay (eyas.engine.ahead): a
    short untimed pass in step captures them first, so that no capture lands in a phase's time."""
    with ablated("decode_ahead", "0"):
        eng.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    eng.profiler = Profiler(DEVICE)
    eng.generate([prompt], SamplingParams(max_tokens=new_tokens or NEW_TOKENS, ignore_eos=True))
    summary = eng.profiler.summary()
    eng.profiler = None
    return summary


def eyas_speed(model_path, prompts, dtype, draft=None, spec=None, new_tokens=None):
    eng = eyas_engine(model_path, dtype, prompts[0], draft, spec)
    run = timed_run(eng, prompts, new_tokens)
    out = dict(tok_s=run["tok_s"], tokens=run["tokens"], seconds=run["seconds"], digest=run["digest"])
    if draft is not None:
        out["accept_length"] = (run["tokens"] - len(prompts)) / run["passes"]
        out["profile"] = cycle_phases(eng, prompts[0], new_tokens)
    return out, eng


def hf_speed(model_path, prompts, new_tokens=None, lookup=False):
    from transformers import AutoModelForCausalLM
    new_tokens = new_tokens or NEW_TOKENS
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16).to(DEVICE).eval()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    kw.update(prompt_lookup_num_tokens=10) if lookup else kw.update(cache_implementation="static")
    toks, secs = 0, 0.0
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        # On CUDA, generate() with a static cache compiles the forward for the cache's shape (prompt + new
        # tokens), so every new prompt length compiles again. The same call once first, untimed, so the timed
        # call is HF's compiled steady state, as eyas is timed after its graphs are captured.
        model.generate(ids, **kw)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync()
        secs += time.perf_counter() - t0
        toks += out.shape[1] - ids.shape[1]
    return dict(tok_s=toks / secs, tokens=toks, seconds=secs)


def hf_speed_isolated(model_path, prompts, lookup=False):
    """hf_speed in a child process of its own. transformers compiles the static-cache forward with
    torch.compile; after the warmed-up HF runs, the next eyas graph run in the same process failed with an
    illegal memory access (H200, torch 2.11; not diagnosed further). A separate process keeps
    each side's compiled state, and its numbers, its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_hf_child, DEVICE, NEW_TOKENS, str(model_path), prompts, lookup).result()


def _hf_child(device, new_tokens, model_path, prompts, lookup):
    global DEVICE, NEW_TOKENS
    DEVICE, NEW_TOKENS = device, new_tokens
    return hf_speed(model_path, prompts, lookup=lookup)


def phase_costs(eng, context=300):
    """Median ms of a target decode step, verify passes of 4 and 8 tokens, and one draft step, at one context."""
    r = eng.runner
    res = {}

    def timed(fn):
        return median_ms(fn, reps=50, cuda=DEVICE == "cuda")

    for T in (1, 4, 8):
        ids = torch.randint(0, 1000, (1, T), device=DEVICE)
        pos = torch.arange(context, context + T, device=DEVICE)[None]
        mask = None if T == 1 else torch.tril(torch.ones(T, T, dtype=torch.bool, device=DEVICE))[None]
        res[f"target_T{T}_ms"] = timed(lambda: eng.target.logits(r.forward(ids, pos, [0], [context], new_mask=mask).hidden))
    decoder = eng.decoder
    if decoder is not None:
        # The whole draft phase of one cycle (graphed when CUDA graphs are on), per draft forward.
        S, k = decoder.spec.steps, decoder.spec.topk
        H, Vd = eng.config.hidden_size, decoder.draft.config.draft_vocab_size
        scores0 = torch.log_softmax(torch.randn(1, Vd, device=DEVICE), -1)
        hidden0 = torch.randn(1, H, device=DEVICE, dtype=eng.dtype)
        root = torch.tensor([5], device=DEVICE)
        c = torch.tensor([context], device=DEVICE)
        slots = torch.tensor([0], device=DEVICE)
        res["draft_phase_ms"] = timed(lambda: decoder.run_padded("tree", decoder.drafter.tree, 1, decoder.kv,
                                                                 context + (S - 1) * k,
                                                                 [scores0, hidden0, root, c, slots], [0, 0, 0, 0, 0]))
        res["draft_step_ms"] = res["draft_phase_ms"] / max(S - 1, 1)
        ids = torch.randint(0, 1000, (1, S + 1), device=DEVICE)
        feats = torch.randn(1, S + 1, 3 * H, device=DEVICE, dtype=eng.dtype)
        last = torch.tensor([S], device=DEVICE)
        res["extend_ms"] = timed(lambda: decoder.run_padded("extend", decoder.drafter.extend, 1, decoder.kv,
                                                            context + S + 1, [ids, feats, last, c, slots],
                                                            [0, 0, 0, 0, 0]))
    res["verify4_over_decode"] = res["target_T4_ms"] / res["target_T1_ms"]
    res["verify8_over_decode"] = res["target_T8_ms"] / res["target_T1_ms"]
    if "draft_step_ms" in res:
        res["draft_over_target"] = res["draft_step_ms"] / res["target_T1_ms"]
    return res


def lossless(model_path, prompts, draft, new_tokens=None, batch=16, dtype="fp32", twin=None):
    """Speculative greedy (chain, tree) against plain greedy, batches of `batch`. With a twin (parse_twin's), plain,
    chain and tree also run with its settings one prompt at a time (where batch-1 paths such as the persistent
    step apply), each against the same plain greedy outputs; each twin row also says what the engine made of the
    settings it reports in its plan summary (`in_force`: persistent_rows is 0 where the kernel does not take the
    target, e.g. an fp32 one unless the twin also sets persistent_skips_fp32=0)."""
    params = SamplingParams(max_tokens=new_tokens or NEW_TOKENS)
    plain = Engine(str(model_path), dtype=dtype, device=DEVICE, max_batch=batch, max_len=2048)
    want = [s.output_ids for s in plain.generate(prompts, params)]
    res = {}
    runs = [(name, spec, None) for name, spec in (("chain", CHAIN), ("tree", TREE))]
    if twin:
        runs += [(f"{name} {twin_name(twin)}", spec, twin) for name, spec in (("plain", None), ("chain", CHAIN),
                                                                             ("tree", TREE))]
    for name, spec, env in runs:
        with ablated(*env) if env else contextlib.nullcontext():
            eng = Engine(str(model_path), dtype=dtype, device=DEVICE, draft=draft if spec else None, spec=spec,
                         max_batch=1 if env else batch, max_len=2048)
            seqs = eng.generate(prompts, params)
        got = [s.output_ids for s in seqs]
        same = sum(a == b for a, b in zip(got, want))
        toks = sum(len(g) - 1 for g in got)
        passes = sum(s.verify_passes for s in seqs)
        entry = dict(identical=same, total=len(prompts), accept_length=toks / max(passes, 1) if spec else None)
        if env:
            summary = eng.execution_plan_summary
            entry["in_force"] = {n: summary[n] for n in env[::2] if n in summary}
        if same != len(prompts):
            entry["divergences"] = divergence_gaps(plain, prompts, want, got)
        res[name] = entry
        del eng
    return res


def divergence_gaps(plain, prompts, want, got):
    """For each differing output: the first differing index and the plain model's top-2 logit gap there."""
    out = []
    for p, w, g in zip(prompts, want, got):
        if w == g:
            continue
        d = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
        ids = torch.tensor([p + w[:d]], device=DEVICE)
        pos = torch.arange(ids.shape[1], device=DEVICE)[None]
        r = plain.runner
        logits = plain.target.logits(r.forward(ids, pos, [0], [0]).hidden[:, -1])[0]
        top2 = logits.topk(2).values
        out.append(dict(index=d, gap=float(top2[0] - top2[1])))
    return out


def acceptance(model_path, tok, draft, dataset, n, batch=32, new_tokens=None):
    """Acceptance length (generated tokens / verify passes, prefill token excluded), greedy, bf16, stop at EOS."""
    from eyas.bench.datasets import load_prompts as lp
    ids = [encode_messages(tok, p.messages) for p in lp(dataset)[:n]]
    res = {}
    for name, spec in (("chain", CHAIN), ("tree", TREE)):
        eng = Engine(str(model_path), dtype="bf16", device=DEVICE, draft=draft, spec=spec, max_batch=batch, max_len=2048)
        seqs = eng.generate(ids, SamplingParams(max_tokens=new_tokens or NEW_TOKENS))
        toks = sum(len(s.output_ids) - 1 for s in seqs)
        res[name] = dict(prompts=len(ids), accept_length=toks / max(sum(s.verify_passes for s in seqs), 1))
        del eng
    return res


def cycle_profile(model_path, prompt, draft, spec, cycles=20):
    """Steady-state cycles of one sequence (graphs captured during the warm-up): their wall time as they run,
    then the same number under torch.profiler, then the eyas profiler's per-phase GPU times over as many."""
    from torch.profiler import ProfilerActivity, profile

    eng = Engine(str(model_path), dtype="bf16", device=DEVICE, draft=draft, spec=spec, max_batch=1, max_len=2048)
    seq = eng.add(prompt, SamplingParams(max_tokens=80 + 30 * cycles, ignore_eos=True))
    for _ in range(40):  # prefill, graph captures, first cycles
        eng.step()
    sync()
    t0, tokens, passes = time.perf_counter(), len(seq.output_ids), seq.verify_passes
    for _ in range(cycles):
        eng.step()
    sync()
    cycle_ms = (time.perf_counter() - t0) / cycles * 1e3
    accept = (len(seq.output_ids) - tokens) / max(seq.verify_passes - passes, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    sync()
    with profile(activities=activities) as trace:
        t0 = time.perf_counter()
        for _ in range(cycles):
            eng.step()
        sync()
        wall = time.perf_counter() - t0
    events = trace.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    count = lambda name: sum(e.name == name for e in events)  # noqa: E731
    # The eyas profiler's cycles run in step with the host, through the phase graphs that cycles ahead of it
    # never replay (eyas.engine.ahead): a few steps in step capture them first, untimed.
    with ablated("decode_ahead", "0"):
        for _ in range(3):
            eng.step()
    eng.profiler = prof = Profiler(DEVICE)
    for _ in range(cycles):
        eng.step()
    phases = {k: sum(v) / cycles for k, v in prof.drain().items()}
    return dict(cycles=cycles, cycle_ms=cycle_ms, accept_length=accept, host_wall_ms=wall / cycles * 1e3,
                gpu_busy_ms=sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / cycles,
                kernels_per_cycle=len(kernels) / cycles,
                graph_launches_per_cycle=count("cudaGraphLaunch") / cycles,
                eager_kernel_launches_per_cycle=count("cudaLaunchKernel") / cycles,
                aten_ops_per_cycle=sum(e.name.startswith("aten::") for e in events) / cycles,
                phase_ms_per_cycle=phases, kernels_by_name=kernels_by_name(kernels, cycles))


def cycle_profiles(model_path, prompt, draft, cycles=20, report=None, twin=None, specs=None) -> dict:
    """cycle_profile of the chain and the tree as they run (a cycle ahead of the host is one CUDA graph), or of
    each of `specs` (rows named steps/topk/draft tokens), and, given a `twin` (parse_twin's), of each with those
    settings. `report(name, row)` is called as each row is measured."""
    rows = {}
    settings = [(spec_name(s), s) for s in specs] if specs else [("chain", CHAIN), ("tree", TREE)]
    for name, spec in settings:
        for row_name, env in [(name, None)] + ([(f"{name} {twin_name(twin)}", twin)] if twin else []):
            with ablated(*env) if env else contextlib.nullcontext():
                rows[row_name] = cycle_profile(model_path, prompt, draft, spec, cycles=cycles)
            if report:
                report(row_name, rows[row_name])
    return rows


def batch_scaling(model_path, prompts, draft, batches, new_tokens=None, rounds=1, report=None):
    """Plain decoding, the chain always, and the chain under the adaptive policy: one engine per mode (slots
    for the largest batch), all three built and warmed up first (every batch bucket's graphs, as `eyas serve`
    captures them at start). Per batch size each engine runs once untimed (for the adaptive policy its first
    windows of both modes and a switch back, whose catch-up pass compiles its kernels), then the three are
    timed in `rounds` rounds, each in the opposite order of the one before: a short run at a large batch moves
    by 10-15% between processes (docs/BENCHMARKS.md), so the modes are compared side
    by side in time. Reported per mode: the median tok/s, every round's, and every round's phases
    (generate_with_phases: prefill and first step, full batch, tail); the adaptive rows also say what
    the policy believed after the last round and where that round's time went. `report(row)` is called as
    each batch size's row is complete, so a run cut off by a time limit still shows the rows it measured."""
    import statistics

    new_tokens = new_tokens or NEW_TOKENS
    modes = {"plain": None, "chain": CHAIN, "adaptive": SpecConfig(3, 1, adaptive=True)}
    engines, started = {}, time.perf_counter()
    for name, spec in modes.items():
        engines[name] = Engine(str(model_path), dtype="bf16", device=DEVICE, draft=draft if spec else None,
                               spec=spec, max_batch=max(batches), max_len=2048)
        engines[name].warm_up()
    print(f"scaling: {len(engines)} engines built and warmed up in {time.perf_counter() - started:.0f} s",
          file=sys.stderr, flush=True)
    rows = {B: {"batch": B} for B in batches}
    for B in batches:
        batch = [prompts[i % len(prompts)] for i in range(B)]
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        for eng in engines.values():
            eng.generate(batch, params)
        sync()
        runs, adaptive_rounds, phase_rounds = {name: [] for name in modes}, [], {name: [] for name in modes}
        for name in alternating_rounds(modes, rounds):
            eng = engines[name]
            adaptive = modes[name] is not None and modes[name].adaptive
            if adaptive:
                eng.decoder.policy.recent.clear()  # this timed run's windows only
                prefill_before = eng.decoder.policy.seconds["prefill"]
            seqs, phases = generate_with_phases(eng, batch, params)
            seconds = phases["seconds"]
            phase_rounds[name].append(phases)
            if adaptive:
                policy = eng.decoder.policy
                adaptive_rounds.append(dict(seconds=round(seconds, 4),
                                            prefill=round(policy.seconds["prefill"] - prefill_before, 4),
                                            by_bucket=time_by_bucket(closed_windows(policy))))
            toks = sum(len(s.output_ids) for s in seqs)
            passes = max(sum(s.verify_passes for s in seqs), 1)
            runs[name].append((toks / seconds, (toks - B) / passes))
        for name, spec in modes.items():
            rows[B][f"{name}_tok_s"] = statistics.median(x[0] for x in runs[name])
            rows[B][f"{name}_tok_s_rounds"] = [round(x[0], 1) for x in runs[name]]
            rows[B][f"{name}_phases_rounds"] = phase_rounds[name]
            if spec:
                rows[B][f"{name}_accept_length"] = runs[name][-1][1]
        rows[B].update(adaptive_books(engines["adaptive"].decoder.policy))
        rows[B]["adaptive_rounds_books"] = adaptive_rounds
        if report:
            report(rows[B])
    out = [rows[B] for B in batches]
    return dict(rows=out, rounds=rounds, **where_speculation_stops_paying(out))


def generate_with_phases(eng, prompts, params) -> tuple[list, dict]:
    """eng.generate, timed in three phases (seconds): `first_step` (the prefill and the first decode step or
    cycle), `full` (steps while no sequence had finished) and `tail` (from the step that finished the first
    sequence to the end, the GPU's last work included). With a fixed length plain decoding finishes every
    sequence on one step; a speculative batch's sequences finish on different cycles, and its last ones run
    at a small batch. Times are the host's, read as each step returns (steps may run ahead of the host)."""
    t0 = time.perf_counter()
    seqs = [eng.add(p, params) for p in prompts]
    first = tail = None
    while eng.has_work():
        eng.step()
        now = time.perf_counter()
        first = first or now
        if tail is None and any(s.finished for s in seqs):
            tail = now
    sync()
    end = time.perf_counter()
    first, tail = first or end, tail or end
    return seqs, dict(seconds=round(end - t0, 4), first_step=round(first - t0, 4),
                      full=round(max(tail - first, 0.0), 4), tail=round(end - tail, 4))


def phase_cell(rounds: list[dict]) -> str:
    """The round of median wall time as 'first step / full / tail' in ms."""
    if not rounds:
        return ""
    mid = sorted(rounds, key=lambda p: p["seconds"])[(len(rounds) - 1) // 2]
    return " / ".join(f"{1000 * mid[k]:.1f}" for k in ("first_step", "full", "tail"))


def alternating_rounds(items, rounds: int):
    """Each item once per round, every round in the opposite order of the one before (A B C, C B A, A B C):
    an effect of position in a round shows as a spread between rounds, not as a difference between items."""
    order = list(items)
    for r in range(rounds):
        yield from order if r % 2 == 0 else order[::-1]


def where_speculation_stops_paying(rows: list[dict]) -> dict:
    """The batch sizes at which the fixed chain was slower than plain decoding, and the smallest from which it
    was slower at every larger batch measured (None when the largest paid). A chain can lose at batch 1 (one
    prompt's acceptance) and pay from 8 on: that is not where it stops paying."""
    ordered = sorted(rows, key=lambda r: r["batch"])
    slower = [r["batch"] for r in ordered if r["chain_tok_s"] < r["plain_tok_s"]]
    stops = None
    for r in reversed(ordered):
        if r["chain_tok_s"] >= r["plain_tok_s"]:
            break
        stops = r["batch"]
    return dict(chain_slower_at=slower, speculation_stops_paying_from=stops)


def closed_windows(policy) -> list[dict]:
    """The policy's windows closed since its `recent` was last cleared, with their rates (tokens/s per
    sequence); void and empty ones left out."""
    closed = [w for w in policy.windows_closed() if w["seconds"] > 0 and not w["void"]]
    for w in closed:
        w["rate"] = w["tokens"] / (w["sequences"] / w["steps"]) / w["seconds"]
    return closed


def time_by_bucket(closed: list[dict]) -> dict:
    """{"bucket/spec" or "bucket/plain": {"seconds", "tokens"}} summed over these windows."""
    by_bucket = {}
    for w in closed:
        key = f"{w['bucket']}/{'spec' if w['speculated'] else 'plain'}"
        seconds, tokens = by_bucket.get(key, (0.0, 0))
        by_bucket[key] = (seconds + w["seconds"], tokens + w["tokens"])
    return {k: dict(seconds=round(v[0], 4), tokens=v[1]) for k, v in sorted(by_bucket.items())}


def adaptive_books(policy) -> dict:
    """What the adaptive policy believed (its rates and booked seconds, cumulative) and where its last timed
    run went: the six slowest windows, and seconds and tokens per bucket and mode (a batch's tail, as its
    sequences finish, runs at the small buckets). batch_scaling adds each timed round's seconds, prefill
    and time per bucket (`adaptive_rounds_books`): a round that lost to the fixed chain shows where."""
    snap = policy.snapshot()
    closed = closed_windows(policy)
    rates = {f"{b}/{'spec' if sp else 'plain'}": round(r, 1) for (b, sp), r in sorted(snap["rates"].items())}
    return dict(adaptive_rates=rates, adaptive_seconds={k: round(v, 3) for k, v in snap["seconds"].items()},
                adaptive_slowest_windows=sorted(closed, key=lambda w: w["rate"])[:6],
                adaptive_time_by_bucket=time_by_bucket(closed))


def parse_specs(text: str, flag: str = "--specs") -> list[SpecConfig]:
    """'3/1,5/4/8' -> [SpecConfig(3, 1), SpecConfig(5, 4, 8)], each speculating at every step; a bad entry
    exits with a one-line error."""
    specs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split("/")
        if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"bench_smollm2: {flag} entry {item!r} is not steps/topk[/draft tokens]")
        try:
            specs.append(SpecConfig(*map(int, parts), adaptive=False))
        except EyasError as e:
            raise SystemExit(f"bench_smollm2: {flag} entry {item!r}: {e}") from None
    return specs


def parse_twin(text: str) -> tuple[str, ...] | None:
    """--twin NAME=VALUE[,NAME=VALUE...] as (NAME, VALUE, NAME, VALUE, ...), ablated's arguments; empty: None."""
    if not text:
        return None
    pairs = []
    for item in text.split(","):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise SystemExit(f"bench_smollm2: --twin takes NAME=VALUE[,NAME=VALUE...], got {text!r}")
        pairs += [name.strip(), value.strip()]
    return tuple(pairs)


def twin_name(twin: tuple[str, ...]) -> str:
    """'A=1,B=2' for the twin ("A", "1", "B", "2"): its rows' suffix."""
    return ",".join(f"{n}={v}" for n, v in zip(twin[::2], twin[1::2]))


def spec_name(spec: SpecConfig) -> str:
    return f"{spec.steps}/{spec.topk}/{spec.draft_tokens}"


def sweep(model_path, prompts, draft, specs, rounds=2, twin=None):
    """Plain decode and each setting on the same prompts, every engine built first and kept, then timed in
    `rounds` rounds, each in the opposite order of the one before (A B C, C B A, ...): an effect of build
    or timing order would show as a spread between rounds instead of as a difference between settings.
    With a twin, plain decoding is timed with its settings too (plain_twin_tok_s).
    Per setting: median tok/s over the rounds, every round's, acceptance, the speed-up over plain's median,
    and the cycle's phases from a separate profiled pass. `twin` (NAME, VALUE, ...): each setting also as an
    engine with those settings (ablation.py) while it is built and whenever it runs (switches read as
    kernels launch reach the graphs captured later, at longer contexts, too), a row of its own beside it."""
    import statistics

    names, engines, envs = ["plain"], [eyas_engine(model_path, "bf16", prompts[0])], [None]
    if twin:  # plain decoding with the twin's settings too
        with ablated(*twin):
            engines.append(eyas_engine(model_path, "bf16", prompts[0]))
        names.append(f"plain {twin_name(twin)}")
        envs.append(twin)
    first_spec = len(names)
    for s in specs:
        for env in (None, twin) if twin else (None,):
            with ablated(*env) if env else contextlib.nullcontext():
                engines.append(eyas_engine(model_path, "bf16", prompts[0], draft, s))
            names.append(f"{spec_name(s)} {twin_name(env)}" if env else spec_name(s))
            envs.append(env)

    def under_env(i, fn, *args):
        with ablated(*envs[i]) if envs[i] else contextlib.nullcontext():
            return fn(engines[i], *args)

    row_specs = [s for s in specs for _ in range(2 if twin else 1)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in alternating_rounds(range(len(names)), rounds):
        runs[names[i]].append(under_env(i, timed_run, prompts))
    median = {n: statistics.median(x["tok_s"] for x in runs[n]) for n in names}
    rows = []
    for i, (name, spec) in enumerate(zip(names[first_spec:], row_specs), start=first_spec):
        run = runs[name][0]
        phases = under_env(i, cycle_phases, prompts[0])
        rows.append(dict(spec=name, tok_s=median[name], tok_s_rounds=[x["tok_s"] for x in runs[name]],
                         accept_length=(run["tokens"] - len(prompts)) / run["passes"],
                         over_plain=median[name] / median["plain"],
                         phase_ms={k: v["mean_ms"] for k, v in phases["phases"].items()},
                         accept_rate_by_position=phases["accept_rate_by_position"]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "accept_rate_by_position"}), flush=True)
    del engines
    chains = [r for r, spec in zip(rows, row_specs) if spec.topk == 1]
    trees = [r for r, spec in zip(rows, row_specs) if spec.topk > 1]
    best = lambda rs: max(rs, key=lambda r: r["tok_s"])["spec"] if rs else None  # noqa: E731
    plain_twin = {"plain_twin": names[1], "plain_twin_tok_s": median[names[1]],
                  "plain_twin_tok_s_rounds": [x["tok_s"] for x in runs[names[1]]]} if twin else {}
    return dict(plain_tok_s=median["plain"], plain_tok_s_rounds=[x["tok_s"] for x in runs["plain"]], rounds=rounds,
                **plain_twin, rows=rows, best_chain=best(chains), best_tree=best(trees))


def cycle_arithmetic(tok_s: float, accept_length: float, plain_tok_s: float, spec: str) -> dict:
    """What a setting's measured speed says about its cycle: `cycle_ms` (acceptance / tok/s: a cycle's share of
    the run, prefill and the host's gaps included, as plain's tok/s includes them), the `ceiling` over plain
    if every drafted token were accepted (steps + 1 tokens per cycle: a chain's length, a tree's deepest
    path) at that cycle cost, and the tokens per cycle it would take to decode at twice plain's tok/s."""
    steps = int(spec.split("/", 1)[0])
    cycle_s = accept_length / tok_s
    return dict(cycle_ms=1000 * cycle_s, ceiling=(steps + 1) / cycle_s / plain_tok_s,
                tokens_for_2x=2 * plain_tok_s * cycle_s)


def speed_label(name: str) -> str:
    """A speed row's name as a table says it: eyas_chain_unfused -> 'eyas chain 3/1/4 unfused'."""
    named = {"hf_static": "HF generate, static cache", "hf_prompt_lookup": "HF prompt lookup"}
    if name in named:
        return named[name]
    for prefix, spec in (("eyas_chain", CHAIN), ("eyas_tree", TREE)):
        if name == prefix or name.startswith(prefix + "_"):
            name = f"{prefix} {spec_name(spec)}{name[len(prefix):]}"
    return name.replace("_", " ")


def markdown_report(results: dict) -> str:
    """The run's measured sections as markdown tables, under its header (md_tables.run_header)."""
    parts = [results["header"]]
    speed = results.get("speed")
    if speed:
        plain = speed.get("eyas_plain", {}).get("tok_s")
        rows = [[speed_label(n), r["tok_s"], r.get("accept_length"), ratio(r["tok_s"], plain)]
                for n, r in speed.items()]
        parts.append(f"Batch 1, {NEW_TOKENS} new tokens per prompt, greedy:\n\n"
                     + table(["row", "tok/s", "acceptance", "over eyas plain"], rows))
        hf = speed.get("hf_static", {}).get("tok_s")
        chain = speed.get("eyas_chain", {}).get("tok_s")
        parts.append(f"eyas plain / HF static cache: {ratio(plain, hf) or 'not run'}; eyas chain "
                     f"{spec_name(CHAIN)} / eyas plain: {ratio(chain, plain) or 'not run'}.")
        accepted = speed.get("eyas_chain", {}).get("accept_length")
        if chain and plain and accepted:
            bound = cycle_arithmetic(chain, accepted, plain, spec_name(CHAIN))
            parts.append(f"The chain's cycle: {bound['cycle_ms']:.3f} ms (acceptance / tok/s), a plain token "
                         f"{1000 / plain:.3f} ms; a draft always right would give {bound['ceiling']:.2f}× plain at "
                         f"that cycle, and 2× needs {bound['tokens_for_2x']:.2f} tokens per cycle.")
    scaling = results.get("scaling")
    if scaling and scaling.get("rows"):
        rows = []
        for r in scaling["rows"]:
            faster = max(r["plain_tok_s"], r["chain_tok_s"])
            rows.append([r["batch"], r["plain_tok_s"], f"{r['chain_tok_s']:,.1f} ({r['chain_accept_length']:.2f})",
                         r["adaptive_tok_s"], ratio(r["adaptive_tok_s"], faster),
                         ratio(r["chain_tok_s"], r["plain_tok_s"])])
        rounds = scaling.get("rounds", 1)
        parts.append(f"Batch scaling, tok/s, the median of {rounds} round{'' if rounds == 1 else 's'}:\n\n"
                     + table(["batch", "plain", f"chain {spec_name(CHAIN)} (acceptance)", "adaptive",
                              "adaptive / faster fixed", "chain / plain"], rows))
        if "chain_slower_at" in scaling:
            slower = ", ".join(str(b) for b in scaling["chain_slower_at"]) or "none measured"
            stops = scaling["speculation_stops_paying_from"]
            tail = (f"from batch {stops} on at every batch measured" if stops
                    else "it paid at the largest batch measured")
            parts.append(f"The fixed chain was slower than plain decoding at batch: {slower}; {tail}.")
        phased = [r for r in scaling["rows"] if r.get("plain_phases_rounds")]
        if phased:
            parts.append("Where each mode's median round went, ms: prefill and first step / full batch / tail "
                         "(from the first sequence finished):\n\n"
                         + table(["batch", "plain", "chain", "adaptive"],
                                 [[r["batch"]] + [phase_cell(r[f"{m}_phases_rounds"]) for m in ("plain", "chain",
                                                                                                "adaptive")]
                                  for r in phased]))
    cycle = results.get("cycle")
    if cycle:
        rows = [[name, f"{r['cycle_ms']:.4f}", f"{r['accept_length']:.2f}", f"{r['kernels_per_cycle']:.0f}",
                 f"{r['graph_launches_per_cycle']:.1f}", f"{r['eager_kernel_launches_per_cycle']:.1f}",
                 f"{r['host_wall_ms']:.4f}", f"{r['gpu_busy_ms']:.4f}",
                 ", ".join(f"{k} {v:.3f}" for k, v in r["phase_ms_per_cycle"].items())] for name, r in cycle.items()]
        parts.append("One speculative cycle at batch 1 (ms per cycle; phases from the eyas profiler, in step with "
                     "the host):\n\n"
                     + table(["setting", "cycle", "acceptance", "kernels", "graph launches", "eager launches",
                              "host wall (profiled)", "GPU busy", "phases"], rows, right=set(range(1, 8))))
    sweep = results.get("sweep")
    if sweep:
        plain = sweep["plain_tok_s"]
        rows = [["plain", plain, "1.000×", "", "", "", "", "", f"{1000 / plain:.3f}", "", "",
                 " / ".join(f"{x:,.1f}" for x in sweep["plain_tok_s_rounds"])]]
        if "plain_twin" in sweep:
            twin = sweep["plain_twin_tok_s"]
            rows.append([sweep["plain_twin"], twin, f"{twin / plain:.3f}×", "", "", "", "", "", f"{1000 / twin:.3f}",
                         "", "", " / ".join(f"{x:,.1f}" for x in sweep["plain_twin_tok_s_rounds"])])
        for r in sweep["rows"]:
            ph, bound = r["phase_ms"], cycle_arithmetic(r["tok_s"], r["accept_length"], plain, r["spec"])
            rows.append([r["spec"], r["tok_s"], f"{r['over_plain']:.3f}×", f"{r['accept_length']:.2f}",
                         *(f"{ph.get(k, 0.0):.3f}" for k in ("draft", "verify", "commit", "accept")),
                         f"{bound['cycle_ms']:.3f}", f"{bound['ceiling']:.2f}×", f"{bound['tokens_for_2x']:.2f}",
                         " / ".join(f"{x:,.1f}" for x in r["tok_s_rounds"])])
        n = sweep["rounds"]
        parts.append(f"Settings side by side, {n} round{'' if n == 1 else 's'} of alternating order (the median "
                     "tok/s; phases in ms per cycle, profiled in step with the host; `cycle` is the run's own: "
                     "acceptance / tok/s, a plain token's for plain; `ceiling`: over plain with every drafted "
                     "token accepted at that cycle; `2× needs`: tokens per cycle for twice plain's tok/s):\n\n"
                     + table(["setting", "tok/s", "over plain", "acceptance", "draft", "verify", "commit", "accept",
                              "cycle ms", "ceiling", "2× needs", "rounds"], rows))
    return "\n\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="random")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--lossless", type=int, default=80)
    ap.add_argument("--sections", default="speed,phases,lossless,bf16,accept")
    ap.add_argument("--hf-prompts", type=int, default=3)
    ap.add_argument("--accept-prompts", type=int, default=None, help="default: all 80 MT-bench and 164 HumanEval")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--accept-sets", type=int, default=2, help="1 = MT-bench only, 2 = MT-bench and HumanEval")
    ap.add_argument("--batches", default="1,8,32,64", help="batch sizes of the scaling section")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pdl", action="store_true",
                    help="speed: also each eyas engine without programmatic dependent launch (plan: pdl=0), beside it")
    ap.add_argument("--in-step", action="store_true",
                    help="plain, chain, tree and --also-specs also with the host in step with the GPU "
                         "(plan: decode_ahead=0), each beside its twin; says whether the tokens matched")
    ap.add_argument("--old-step", action="store_true",
                    help="plain and chain also with the attention's short rows in one pass and cuBLAS for the output "
                         "projection (plan: short_row_splits=0, fused_o_proj=0)")
    ap.add_argument("--also-specs", default="",
                    help="speed: rows for these settings too (steps/topk[/draft tokens]), then plain again, last")
    ap.add_argument("--specs", default=SWEEP_SPECS, help="sweep: settings as steps/topk[/draft tokens], comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="sweep and scaling: timing rounds over all engines, "
                    "alternating order")
    ap.add_argument("--twin", default="",
                    help="sweep: each setting also built with NAME=VALUE[,NAME=VALUE...] set, a row beside it; "
                         "lossless and bf16: plain, chain and tree with them, batch 1: execution plan fields (e.g. "
                         "fused_linear=0, persistent_rows=8)")
    ap.add_argument("--out", default="bench_smollm2.json")
    ap.add_argument("--markdown", default="", help="also write the measured sections as markdown tables to this "
                    "file, rewritten as rows and sections end (for docs/BENCHMARKS.md)")
    args = ap.parse_args()
    global DEVICE, NEW_TOKENS
    DEVICE, NEW_TOKENS = args.device, args.new_tokens
    sections = set(args.sections.split(","))
    specs = parse_specs(args.specs) if "sweep" in sections else []
    also_specs = parse_specs(args.also_specs, "--also-specs")  # bad input fails now, not after the first rows
    if args.rounds < 1:
        raise SystemExit(f"bench_smollm2: --rounds must be at least 1, got {args.rounds}")
    writable(args.out, "bench_smollm2")
    writable(args.markdown, "bench_smollm2")
    twin = parse_twin(args.twin)
    path = demo_model_path()
    tok = load_tokenizer(path)
    results = dict(kernels=os.environ.get("EYAS_KERNELS", "1"),
                   gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                   python=platform.python_version(),
                   date=time.strftime("%Y-%m-%d"), draft=args.draft, header=run_header(DEVICE))

    def save():
        """The JSON results, and the markdown tables with --markdown: as rows and sections end, so a run cut
        off by a time limit keeps what it measured."""
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        if args.markdown:
            Path(args.markdown).write_text(markdown_report(results))

    draft = draft_arg(args, path)
    prompts = prompts_ids(tok, max(args.prompts, args.lossless))
    if "speed" in sections:
        sp = results["speed"] = {}

        def row_done(name):
            """Each row as it is measured: a run cut short by a time limit still reports what it had."""
            print(json.dumps({"row": name, "tok_s": round(sp[name]["tok_s"], 1),
                              "accept_length": sp[name].get("accept_length")}), flush=True)
            save()

        def speed(name, *engine, env=None):
            """One eyas engine's row; with env (variable, value) set while it is built and run."""
            with ablated(*env) if env else contextlib.nullcontext():
                sp[name], eng = eyas_speed(path, prompts[:args.prompts], "bf16", *engine)
            row_done(name)
            return eng

        speed("eyas_plain")
        if args.pdl:  # each engine beside its twin without programmatic dependent launch (eyas.kernels.pdl)
            speed("eyas_plain_pdl_off", env=("pdl", "0"))
        speed("eyas_chain", draft, CHAIN)
        if args.in_step:  # not a step or cycle ahead of the host (eyas.engine.ahead)
            speed("eyas_plain_in_step", env=IN_STEP)
            speed("eyas_chain_in_step", draft, CHAIN, env=IN_STEP)
        if args.old_step:
            speed("eyas_plain_old_step", env=OLD_STEP)
            speed("eyas_chain_old_step", draft, CHAIN, env=OLD_STEP)
        if args.pdl:
            speed("eyas_chain_pdl_off", draft, CHAIN, env=("pdl", "0"))
        # the same two engines without the fused norm/activation + projection kernels
        speed("eyas_plain_unfused", env=("fused_linear", "0"))
        speed("eyas_chain_unfused", draft, CHAIN, env=("fused_linear", "0"))
        eng = speed("eyas_tree", draft, TREE)
        if args.in_step:
            speed("eyas_tree_in_step", draft, TREE, env=IN_STEP)
        if args.pdl:
            speed("eyas_tree_pdl_off", draft, TREE, env=("pdl", "0"))
        for spec in also_specs:  # e.g. the sweep's fastest chain and tree
            speed(f"eyas_{spec_name(spec)}", draft, spec)
            if args.in_step:
                speed(f"eyas_{spec_name(spec)}_in_step", draft, spec, env=IN_STEP)
        if also_specs:  # plain again, built last: an order effect of the script would show as a gap
            speed("eyas_plain_last")
        if args.hf_prompts > 0:
            sp["hf_static"] = hf_speed_isolated(path, prompts[:args.hf_prompts])
            row_done("hf_static")
            sp["hf_prompt_lookup"] = hf_speed_isolated(path, prompts[:args.hf_prompts], lookup=True)
            row_done("hf_prompt_lookup")
        print(json.dumps({k: round(v["tok_s"], 1) for k, v in sp.items()}), flush=True)
        twins = {k: k[:-len("_in_step")] for k in sp if k.endswith("_in_step")}
        if twins:  # decoding ahead is lossless: each row decodes exactly its twin's tokens
            print(json.dumps({k: sp[k]["digest"] == sp[t]["digest"] for k, t in twins.items()}), flush=True)
        save()
        if "phases" in sections:
            results["phases"] = phase_costs(eng)
            print(json.dumps(results["phases"]), flush=True)
    if "lossless" in sections:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        results["lossless_fp32"] = lossless(path, prompts[:args.lossless], draft, twin=twin)
        print(json.dumps(results["lossless_fp32"])[:2000], flush=True)
    if "bf16" in sections:
        results["lossless_bf16"] = lossless(path, prompts[:args.lossless], draft, dtype="bf16", twin=twin)
        print(json.dumps(results["lossless_bf16"])[:2000], flush=True)
    if "accept" in sections:
        results["accept"] = {}
        for d, n in (("mt-bench", 80), ("humaneval", 164))[:args.accept_sets]:
            results["accept"][d] = acceptance(path, tok, draft, d, args.accept_prompts or n)
            save()
        print(json.dumps(results["accept"]), flush=True)
    if "cycle" in sections:
        results["cycle"] = cycle_profiles(path, prompts_ids(tok, 1)[0], draft)
        print(json.dumps(results["cycle"]), flush=True)
        save()
    if "scaling" in sections:
        def scaling_row(row):  # printed and saved as measured: a run cut off keeps its rows
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            results.setdefault("scaling", {"rows": [], "rounds": args.rounds})["rows"].append(row)
            save()

        results["scaling"] = batch_scaling(path, prompts_ids(tok, 80), draft, [int(b) for b in args.batches.split(",")],
                                           rounds=args.rounds, report=scaling_row)
        print("chain slower than plain at batch", results["scaling"]["chain_slower_at"],
              "and at every batch from", results["scaling"]["speculation_stops_paying_from"])
    if "sweep" in sections:
        results["sweep"] = sweep(path, prompts[:args.prompts], draft, specs, args.rounds, twin)
        print("fastest chain", results["sweep"]["best_chain"], "fastest tree", results["sweep"]["best_tree"])
    save()
    if args.markdown:
        print(f"tables: {args.markdown}", flush=True)


if __name__ == "__main__":
    main()
