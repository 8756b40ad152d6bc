"""Speed of one EAGLE-3 training step (online: target forward + TTT unroll + backward + AdamW), by phase.

Usage: python3 benchmarks/bench_train_step.py [--device cuda] [--steps 30] [--batch-tokens 32768,65536]
           [--profile] [--out result.json]

The target is SmolLM2-135M-shaped with random weights and the draft is the recipe's (`intermediate_size`
2816, 8,192-token vocabulary), so nothing is loaded from disk: speed does not depend on the weights. The
batches are length-bucketed rows drawn like the recipe's data (prompt + reply of 60-520 tokens), through the
same BatchStream and OnlineSource that `eyas train` uses, so each step has its own padded shape; the timed
steps replay the warm-up's batches, as a long run meets each shape many times.

Per batch size: the median step time, the phases (the target's forward; the teacher distributions; the
TTT forward; its backward; clip + AdamW) as CUDA-event medians, tokens/s and peak memory. `--profile` adds
the 20 CUDA kernels that took the most GPU time over 5 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "benchmarks")]

from bench_join import SMOLLM2  # noqa: E402
from bench_moe_mla import random_init  # noqa: E402


def build(device: str, batch_tokens: int, seed: int = 0):
    from eyas.config import ModelConfig
    from eyas.models.llama import CausalLM
    from eyas.train.conversation import Sample
    from eyas.train.draft_init import draft_config_for
    from eyas.train.recipe import TrainConfig
    from eyas.models.eagle3 import Eagle3Draft
    from eyas.train.sources import OnlineSource
    from eyas.train.trainer import Trainer

    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf(SMOLLM2)
    with torch.device("meta"):
        target = CausalLM(cfg, max_positions=1100)
    target = random_init(target, torch.bfloat16, device)
    section = SimpleNamespace(aux_layer_ids=[], draft_vocab_size=8192, intermediate_size=2816, rope_theta=10000.0)
    dcfg = draft_config_for(cfg, section)
    target.capture_layers = dcfg.capture_layers(cfg.num_layers)
    draft = Eagle3Draft(dcfg)
    used = torch.randperm(cfg.vocab_size)[:8192].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(4096):
        prompt = int(torch.randint(20, 120, (), generator=gen))
        reply = int(torch.randint(40, 400, (), generator=gen))
        ids = torch.randint(0, cfg.vocab_size, (prompt + reply,), generator=gen)
        samples.append(Sample(ids, torch.arange(prompt + reply) >= prompt))
    source = OnlineSource(target, samples, batch_tokens, seed, used, t2d, device)
    tcfg = TrainConfig(steps=100_000, batch_tokens=batch_tokens, lr=3e-4, warmup_steps=10)
    return Trainer(tcfg, draft, source, Path("/tmp/eyas-bench-train-step"), device, progress=False)


def timed_steps(trainer, steps: int, warmup: int) -> dict:
    """Each step timed as a whole (host clock after a sync) and by phase (CUDA events), as Trainer.train_step
    runs it."""
    from contextlib import nullcontext

    from eyas.train.target import run_target

    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    source = trainer.source
    names = ("target_ms", "teacher_ms", "ttt_forward_ms", "ttt_backward_ms", "clip_adamw_ms")
    phases = {n: [] for n in names}
    whole, tokens = [], []
    # The warm-up runs the very batches that are timed next: every padded shape has been seen once
    # (cuDNN builds an attention plan per new shape, a cost a long run pays once per shape, not per step).
    start = source.stream.state()
    for i in range(warmup + steps):
        if i == warmup:
            source.stream.load_state(start)
        batch = source.stream.next()
        sync()
        t0 = time.perf_counter()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)] if cuda else []
        mark = (lambda j: ev[j].record()) if cuda else (lambda j: None)
        mark(0)
        with torch.no_grad():
            b = batch.to(source.device)
            out = run_target(source.target, b.input_ids)
            embeds = source.target.embed(b.input_ids)
            mark(1)
            teacher = source._teacher(source.target.lm_head(out.hidden), b.loss_mask, b.input_ids)
            mark(2)
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
        with amp:
            loss, _ = trainer.ddp(embeds, out.features, teacher)
        mark(3)
        trainer.opt.zero_grad(set_to_none=True)
        loss.backward()
        mark(4)
        torch.nn.utils.clip_grad_norm_(trainer.draft.parameters(), trainer.cfg.grad_clip)
        trainer.opt.step()
        trainer.sched.step()
        mark(5)
        sync()
        if i >= warmup:
            whole.append((time.perf_counter() - t0) * 1e3)
            tokens.append(batch.tokens)
            for j, n in enumerate(names):
                if cuda:
                    phases[n].append(ev[j].elapsed_time(ev[j + 1]))
    med = lambda xs: round(statistics.median(xs), 2) if xs else None
    return {"step_ms": med(whole), **{n: med(v) for n, v in phases.items()},
            "tokens_per_s": round(sum(tokens) / (sum(whole) / 1e3)), "mean_padded_tokens": round(statistics.mean(tokens))}


def kernel_profile(trainer, steps: int = 5) -> list[dict]:
    """The CUDA kernels with the most GPU time (their own, not their callers')."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(trainer, steps, 0)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return [{"kernel": e.key[:100], "calls_per_step": e.count // steps,
             "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 3)} for e in kernels[:20]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per batch size (default 30)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first, the same batches (default 30)")
    ap.add_argument("--batch-tokens", default="32768", help="comma-separated padded tokens per step (default 32768)")
    ap.add_argument("--profile", action="store_true", help="also list the top CUDA kernels at the first batch size")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.batch_tokens.split(",")]
    except ValueError:
        sys.exit(f"error: --batch-tokens must be comma-separated integers, got {args.batch_tokens!r}")
    if min(sizes) < 1024:
        sys.exit("error: --batch-tokens must be at least 1024 (the longest sample has 520 tokens)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no GPU is visible")
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "runs": {}}
    for n, size in enumerate(sizes):
        trainer = build(args.device, size)
        row = timed_steps(trainer, args.steps, args.warmup)
        if args.device.startswith("cuda"):
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            torch.cuda.reset_peak_memory_stats()
        if args.profile and n == 0:
            row["top_kernels"] = kernel_profile(trainer)
        result["runs"][str(size)] = row
        print(json.dumps({size: row}, indent=1), flush=True)
        del trainer
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
