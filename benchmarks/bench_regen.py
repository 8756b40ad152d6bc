"""The regen stage's throughput: the recipe's engine and `regenerate` loop over the evaluation sets' questions.

    python3 benchmarks/bench_regen.py [--recipe recipes/smollm2-135m-eagle3.toml] [--prompts 4096] [--device cuda]
        [--out regen.json]

The engine is built as the pipeline builds it (the recipe's `[regen] batch`, `[data] max_len`, an eighth of the
batch admitted at a time) and every reply is written as the stage writes it, under a scratch out_dir; the CUDA
graphs are captured inside the timed run, as in the stage. The questions are the first user turns of the four
evaluation sets (MT-bench, HumanEval, ShareGPT, the Python FAQ where installed), repeated up to --prompts.
Reported: replies, generated tokens, tokens/s, the engine's steps and the steps that ran ahead of the host,
and a hash of every reply, so that two code versions run on the same card can be checked to write the same text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from eyas.bench.datasets import load_prompts
from eyas.errors import EyasError
from eyas.models.demo import resolve_model_path
from eyas.train.prompts import Conversation

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-eagle3.toml"


def questions(n: int) -> list[str]:
    texts = []
    for name in ("mt-bench", "humaneval", "sharegpt", "python-faq"):
        try:
            texts += [next(m["content"] for m in p.messages if m["role"] == "user") for p in load_prompts(name)]
        except EyasError as e:  # the Python FAQ needs Debian's python3-doc
            print(f"bench_regen: {name} left out: {e}", file=sys.stderr)
    if not texts:
        raise EyasError("no evaluation set is installed")
    return [texts[i % len(texts)] for i in range(n)]


def run(args) -> dict:
    import torch

    from eyas.engine.engine import Engine
    from eyas.models.tokenizer import load_tokenizer
    from eyas.train.recipe import load_recipe
    from eyas.train.regen import regen_files, regenerate

    with tempfile.TemporaryDirectory() as out:
        overrides = {"out_dir": out} | ({"regen.max_tokens": args.max_tokens} if args.max_tokens else {})
        recipe = load_recipe(args.recipe, overrides)
        target = resolve_model_path(args.model or recipe.target)
        dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
        prompts = [Conversation(f"q{i:06d}", [{"role": "user", "content": q}])
                   for i, q in enumerate(questions(args.prompts))]
        batch = recipe.regen.batch
        engine = Engine(str(target), dtype=dtype, device=args.device, max_batch=batch, max_len=recipe.data.max_len,
                        admit_batch=max(1, batch // 8))
        tokenizer = load_tokenizer(target)
        steps = count_steps(engine)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = regenerate(recipe, engine, tokenizer, prompts, progress=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        digest = hashlib.sha256()
        for f in regen_files(recipe):
            rows = sorted((json.loads(line) for line in f.read_text().splitlines() if line.strip()),
                          key=lambda r: r["id"])
            for r in rows:
                digest.update(json.dumps(r, sort_keys=True).encode())
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": dtype,
            "batch": batch, "prompts": len(prompts), "replies": stats["replies"],
            "generated_tokens": stats["generated_tokens"], "seconds": round(seconds, 2),
            "tokens_per_s": round(stats["generated_tokens"] / seconds, 1),
            "engine_steps": steps[0], "steps_ahead": engine.ahead.flights.sent, "replies_sha256": digest.hexdigest()}


def count_steps(engine) -> list[int]:
    """A counter of the engine's steps (each a decode step here: nothing speculates)."""
    count, step = [0], engine.step

    def counted():
        count[0] += 1
        return step()
    engine.step = counted
    return count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(RECIPE))
    ap.add_argument("--model", default=None, help="the target (default: the recipe's)")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the recipe's [regen] max_tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except EyasError as e:
        print(f"bench_regen: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
