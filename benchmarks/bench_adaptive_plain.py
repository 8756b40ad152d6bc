"""Plain decoding through a speculative engine against the plain engine, batch 1, and where the host time goes.

Under the adaptive policy a speculative engine decodes plainly wherever speculation does not pay (batch 1
of SmolLM2 with its draft, docs/BENCHMARKS.md), and there it ran 0.92x the plain engine's tokens/s. These
decode the same prompt, one after another, rounds alternating in order:

- `plain`: no draft;
- `spec_forced_plain`: the draft loaded, the policy forced to plain steps (each step holds its pair back
  for the draft, flushed every LAG_FLUSH steps; no windows, no waits at window ends);
- `adaptive`: the policy choosing per window (waits where the mode may change, a probe of speculation now
  and then);
- `spec_forced_chain`: the speculative engine forced to chain cycles (3/1/4), for its host time per cycle
  beside the GPU's (a random draft's cycles accept ~1 token, so its tok/s says nothing of a trained one's).

Random weights of SmolLM2-135M's shape and a random draft (no download; a random draft never pays, so the
adaptive engine runs plain windows but for its probes). Then each engine's decode loop once more under
cProfile: the functions with the most own host time per step.

    python3 benchmarks/bench_adaptive_plain.py --tokens 512 --rounds 3 --out adaptive_plain.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the random draft

from bench_join import random_smollm2, settle  # benchmarks/bench_join.py: SmolLM2-135M's shape, random weights

ENGINES = ("plain", "spec_forced_plain", "adaptive", "spec_forced_chain")


def decode(engine, prompt, tokens, policy_forced=None):
    """Decode `tokens` new tokens of `prompt` alone; return tok/s over the decode steps (prefill excluded)
    and the number of steps."""
    from eyas.layers.sampling import SamplingParams

    if engine.decoder is not None:
        engine.decoder.policy.forced = policy_forced
    engine.add(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prefill and the first token
    settle(engine.device)
    start = time.perf_counter()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    settle(engine.device)
    return (tokens - 1) / (time.perf_counter() - start), steps


def build(path: str, device: str) -> dict:
    """The engines over the target at `path`, with one random draft of its width and vocabulary (the two
    forced ones share a speculative engine)."""
    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from tests.helpers import random_draft

    cfg = json.loads((Path(path) / "config.json").read_text())
    draft = random_draft(cfg["hidden_size"], cfg["vocab_size"], draft_vocab=min(32000, cfg["vocab_size"]),
                         head_dim=64)
    common = dict(dtype="bf16" if device == "cuda" else "fp32", device=device, max_batch=4, max_len=2048)
    spec = Engine(path, draft=draft, spec=SpecConfig(3, 1, adaptive=False), **common)
    return {"plain": Engine(path, **common), "spec_forced_plain": spec,
            "adaptive": Engine(path, draft=draft, spec=SpecConfig(3, 1, adaptive=True), **common),
            "spec_forced_chain": spec}


def host_profile(engine, prompt, tokens, policy_forced, top):
    """The functions with the most own (tottime) host seconds in one decode, per decode step, in µs."""
    profiler = cProfile.Profile()
    profiler.enable()
    _, steps = decode(engine, prompt, tokens, policy_forced)
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in list(stats.stats.items()):
        rows.append(dict(function=f"{Path(file).name}:{line}:{name}", calls_per_step=round(calls / steps, 2),
                         own_us_per_step=round(tottime / steps * 1e6, 1),
                         cum_us_per_step=round(cumtime / steps * 1e6, 1)))
    rows.sort(key=lambda r: -r["own_us_per_step"])
    total = sum(r["own_us_per_step"] for r in rows)
    return dict(steps=steps, host_us_per_step_profiled=round(total, 1), top=rows[:top])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="new tokens per decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=15, help="functions listed per engine profile")
    ap.add_argument("--out", default="adaptive_plain.json")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (for a check of the script, not a figure)")
    ap.add_argument("--model", default=None, help="a target checkpoint folder instead of random SmolLM2 weights")
    args = ap.parse_args()
    if not 16 <= args.tokens <= 1500 or args.rounds < 1:
        raise SystemExit("bench_adaptive_plain: --tokens must be in 16..1500 and --rounds >= 1")
    if args.device not in ("cuda", "cpu") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit(f"bench_adaptive_plain: device {args.device!r} is not available (cuda or cpu)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"bench_adaptive_plain: --model {args.model!r} has no config.json")

    prompt = list(range(10, 74))
    with tempfile.TemporaryDirectory() as tmp:
        engines = build(args.model or random_smollm2(Path(tmp)), args.device)
    forced = {"plain": None, "spec_forced_plain": False, "adaptive": None, "spec_forced_chain": True}
    for engine in {id(e): e for e in engines.values()}.values():
        engine.warm_up()
    rates = {name: [] for name in ENGINES}
    for r in range(args.rounds):
        for name in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
            rates[name].append(decode(engines[name], prompt, args.tokens, forced[name])[0])
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (cpu)"
    result = dict(gpu=gpu, torch=torch.__version__, tokens=args.tokens, rounds=args.rounds,
                  engines={})
    base = statistics.median(rates["plain"])
    for name in ENGINES:
        med = statistics.median(rates[name])
        print(f"{name:18s} {med:9.1f} tok/s  x{med / base:.3f}  rounds {min(rates[name]):.1f}-{max(rates[name]):.1f}",
              flush=True)
        result["engines"][name] = dict(tok_s=round(med, 1), over_plain=round(med / base, 4),
                                       rounds_tok_s=[round(v, 1) for v in rates[name]])
    for name in ENGINES:
        prof = host_profile(engines[name], prompt, args.tokens, forced[name], args.top)
        result["engines"][name]["profile"] = prof
        print(f"\n{name}: {prof['host_us_per_step_profiled']} µs of profiled host time per step", flush=True)
        for row in prof["top"]:
            print(f"  {row['own_us_per_step']:7.1f} µs own {row['cum_us_per_step']:8.1f} cum "
                  f"{row['calls_per_step']:6.2f}/step  {row['function']}", flush=True)
    policy = engines["adaptive"].decoder.policy
    result["adaptive_policy"] = dict(rates={f"{b}/{'spec' if s else 'plain'}": round(v, 1)
                                            for (b, s), v in policy.rates.items()},
                                     seconds={k: round(v, 3) for k, v in policy.seconds.items()})
    print("\nadaptive policy", json.dumps(result["adaptive_policy"]))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
