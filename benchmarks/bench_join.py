"""What a joining request costs the engine, plain and speculative: a server's closed loop without HTTP.

Usage: python3 benchmarks/bench_join.py --device cuda --out join.json [--model demo|random|DIR] [--admit 1,8]

`concurrency` sequences run; whenever one finishes, a new one (random prompt ids, 40-120 tokens; a random
budget of 32-256 new tokens, EOS ignored) is added at once, as a loaded server's clients do, until `requests`
have finished. For each engine (plain; the draft with speculation forced on every step) and each admission
batch (`Engine(admit_batch=...)`: 1 admits every free slot at once, as `eyas serve` did; larger waits until
that many slots are free), it reports:
  - throughput of the loop (tokens/s, no synchronisation added), and
  - an instrumented pass of the same loop, the GPU settled around every part of a step: per step that admitted
    requests, the wall ms of the target's prefill, of the draft's prefill (speculative engines) and of the
    decode step or cycle after it; per step without joins, the wall ms of the step.
A serving benchmark booked ~30 ms per joining request to prefill under speculation
at concurrency 64; this isolates where it goes. `--model random` (the default) is SmolLM2-135M's shape with
random weights (timing only: with it the draft's guesses are random, so the speculative throughput says
nothing); `demo` is the real model.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from eyas.engine.engine import Engine
from eyas.engine.sequence import SamplingParams
from eyas.errors import EyasError
from eyas.config import SpecConfig

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)


def random_smollm2(path: Path) -> str:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def settle(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """Wraps a bound method: settles the GPU before and after each call and records its wall ms."""

    def __init__(self, obj, name: str, device):
        self.obj, self.name, self.device, self.ms = obj, name, device, []
        self.inner = getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *args, **kw):
        settle(self.device)
        t0 = time.perf_counter()
        out = self.inner(*args, **kw)
        settle(self.device)
        self.ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def undo(self):
        setattr(self.obj, self.name, self.inner)


def closed_loop(eng: Engine, args, seed: int, instrument: bool) -> dict:
    rng = random.Random(seed)
    vocab = eng.config.vocab_size

    def new_request():
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(40, 120))]
        eng.add(prompt, SamplingParams(max_tokens=rng.randint(32, 256), ignore_eos=True))

    for _ in range(args.concurrency):
        new_request()
    timers = []
    if instrument:
        timers = [Timed(eng, "_prefill", eng.device)]
        if eng.decoder is not None:
            timers.append(Timed(eng.decoder, "prefill", eng.device))
    started, finished, tokens, issued = None, 0, 0, args.concurrency
    join_steps, plain_steps, joined = [], [], []
    settle(eng.device)
    started = time.perf_counter()
    while finished < args.requests:
        waiting = len(eng.waiting)
        before = len(timers[0].ms) if timers else 0
        t0 = time.perf_counter()
        done = eng.step()
        if instrument:
            settle(eng.device)
            ms = (time.perf_counter() - t0) * 1e3
            if len(timers[0].ms) > before:
                prefill = sum(t.ms[-1] for t in timers)
                join_steps.append(ms - prefill)
                joined.append(waiting - len(eng.waiting))
            else:
                plain_steps.append(ms)
        for s in done:
            finished += 1
            tokens += len(s.output_ids)
            if issued < args.requests + args.concurrency:
                new_request()
                issued += 1
    settle(eng.device)
    wall = time.perf_counter() - started
    while eng.has_work():  # drain the extra requests so the next loop starts from an empty engine
        eng.step()
    out = {"tok_s": tokens / wall, "wall_s": wall, "requests": finished}
    if instrument:
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
        out.update(prefill_events=len(timers[0].ms), joined_per_event=sum(joined) / max(1, len(joined)),
                   target_prefill_ms=med(timers[0].ms),
                   draft_prefill_ms=med(timers[1].ms) if len(timers) > 1 else None,
                   step_after_join_ms=med(join_steps), step_without_join_ms=med(plain_steps),
                   prefill_s=sum(sum(t.ms) for t in timers) / 1e3, steps=len(join_steps) + len(plain_steps))
        for t in timers:
            t.undo()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random", help="'random' (SmolLM2-135M's shape), 'demo' or an HF directory")
    ap.add_argument("--draft", default=str(REPO / "assets" / "smollm2-135m-eagle3"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--admit", default="1,8", help="comma list of admission batches")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "join.json")
    args = ap.parse_args(argv)
    try:
        admits = [int(a) for a in args.admit.split(",")]
        if args.concurrency < 1 or args.requests < 1 or min(admits) < 1:
            raise EyasError("--concurrency, --requests and every --admit must be at least 1")
        dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
        tmp = tempfile.TemporaryDirectory()
        model = random_smollm2(Path(tmp.name) / "model") if args.model == "random" else args.model
        rows = []
        for name, draft in (("plain", None), ("speculative", args.draft)):
            for admit in admits:
                spec = SpecConfig(steps=3, topk=1, draft_tokens=4, adaptive=False) if draft else None
                eng = Engine(model, dtype=dtype, device=args.device, draft=draft, spec=spec,
                             max_batch=args.concurrency, max_len=2048, admit_batch=admit)
                if eng.decoder is not None:
                    eng.decoder.policy.forced = True  # speculate on every step
                eng.warm_up()
                if eng.decoder is not None:
                    eng.decoder.policy.forced = True  # warm_up resets it
                fast = closed_loop(eng, args, seed=1, instrument=False)
                timed = closed_loop(eng, args, seed=1, instrument=True)
                row = {"engine": name, "admit_batch": admit, **fast, "instrumented": timed}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del eng
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    except EyasError as e:
        print(f"bench_join: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
