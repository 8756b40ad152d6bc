"""Speed of one EAGLE-3 training step (online: target forward + TTT unroll + backward + AdamW), by phase.

Usage: python3 benchmarks/bench_train_step.py [--device cuda] [--shape smollm2|tiny] [--steps 20]
           [--batch-tokens 32768,65536] [--profile] [--out result.json]

The target is SmolLM2-135M-shaped (or `tiny`, for tests) with random weights and the draft is the recipe's
(`intermediate_size` 2816, 8,192-token vocabulary, both capped by the target's), so nothing is loaded from
disk: speed does not depend on the weights. The batches are length-bucketed rows drawn like the recipe's
data (prompt + reply of 60-517 tokens), through the same BatchStream and OnlineSource that `eyas train`
uses, so each step has its own padded shape; the timed steps replay the warm-up's batches, as a long run
meets each shape many times.

Per batch size: the median step time, the phases (the target's forward; the teacher distributions; the
TTT forward; its backward; clip + AdamW) as CUDA-event medians, tokens/s and peak memory. `--profile` adds
the 20 CUDA kernels that took the most GPU time over 5 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "benchmarks")]

from bench_moe_mla import random_init  # noqa: E402
from bench_prefill import SHAPES  # noqa: E402

from eyas.errors import EyasError  # noqa: E402


def build(device: str, shape: str, batch_tokens: int, seed: int = 0):
    from eyas.config import ModelConfig
    from eyas.models.llama import CausalLM
    from eyas.train.conversation import Sample
    from eyas.train.draft_init import draft_config_for
    from eyas.train.recipe import TrainConfig
    from eyas.models.eagle3 import Eagle3Draft
    from eyas.train.sources import OnlineSource
    from eyas.train.trainer import Trainer

    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf(SHAPES[shape])
    with torch.device("meta"):
        target = CausalLM(cfg, max_positions=1100)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    target = random_init(target, dtype, device)
    vocab = min(8192, cfg.vocab_size)
    section = SimpleNamespace(aux_layer_ids=[], draft_vocab_size=vocab, intermediate_size=min(2816, 2 * cfg.intermediate_size),
                              rope_theta=10000.0)
    dcfg = draft_config_for(cfg, section)
    target.capture_layers = dcfg.capture_layers(cfg.num_layers)
    draft = Eagle3Draft(dcfg)
    used = torch.randperm(cfg.vocab_size)[:vocab].sort().values
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
    return Trainer(tcfg, draft, source, Path(tempfile.gettempdir()) / "eyas-bench-train-step", device, progress=False)


def timed_steps(trainer, steps: int, warmup: int) -> dict:
    """Each step timed as a whole (host clock after a sync) and by phase (CUDA events): OnlineSource.prepare's
    two halves, then Trainer.train_step's rest."""
    from contextlib import nullcontext

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
        b = batch.to(source.device)
        embeds, out = source.target_pass(b)
        mark(1)
        teacher = source.teacher(b, out)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="smollm2", help=", ".join(SHAPES))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per batch size (default 20)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first, the same batches (default 20)")
    ap.add_argument("--batch-tokens", default="32768", help="comma-separated padded tokens per step (default 32768)")
    ap.add_argument("--profile", action="store_true", help="also list the top CUDA kernels at the first batch size")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.shape not in SHAPES:
            raise EyasError(f"unknown --shape {args.shape!r}: choose one of {', '.join(SHAPES)}")
        try:
            sizes = [int(x) for x in args.batch_tokens.split(",")]
        except ValueError:
            raise EyasError(f"--batch-tokens takes a comma list of integers, got {args.batch_tokens!r}") from None
        if min(sizes) < 1024:
            raise EyasError("--batch-tokens must be at least 1024 (the longest sample has 520 tokens)")
        if args.steps < 1 or args.warmup < 0:
            raise EyasError("--steps must be at least 1 and --warmup at least 0")
        cuda = torch.device(args.device).type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise EyasError("--device cuda but no GPU is visible")
        result = {"argv": sys.argv, "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "torch": torch.__version__, "shape": args.shape, "runs": {}}
        for n, size in enumerate(sizes):
            trainer = build(args.device, args.shape, size)
            row = timed_steps(trainer, args.steps, args.warmup)
            if cuda:
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
                torch.cuda.reset_peak_memory_stats()
            if args.profile and n == 0:
                row["top_kernels"] = kernel_profile(trainer)
            result["runs"][str(size)] = row
            print(json.dumps({size: row}, indent=1), flush=True)
            del trainer
            if cuda:
                torch.cuda.empty_cache()
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    except EyasError as e:
        print(f"bench_train_step: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
