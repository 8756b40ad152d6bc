"""Eager prefill vs graphed chunks, side by side, for a model shape: does the runner's rule choose the faster?

`ModelRunner.prefill` runs a few short prompts as CUDA-graph replays of PREFILL_CHUNK-token chunks and the rest
as one eager forward (runner.py). The rule was set from SmolLM2-135M, where an eager forward is bound by its
host-side launches (~22 ms) and a chunk replay costs little. On a large target every chunk reads every weight,
so chunks may lose there. This measures both paths for each (prompts, tokens) pair, on random weights built in
memory, and prints which one the rule picks.

    python3 benchmarks/bench_prefill.py --shape smollm2 --device cuda
    python3 benchmarks/bench_prefill.py --shape llama-8b --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# benchmarks/ (the script's own folder is on sys.path): the shapes and the random fill the other scripts use
from bench_join import SMOLLM2
from bench_moe_mla import random_init
from bench_tp import LLAMA_8B
from eyas.config import ModelConfig
from eyas.engine.runner import ModelRunner
from eyas.errors import EyasError
from eyas.models.llama import CausalLM
from timing import median_ms

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "smollm2": SMOLLM2,
    "llama-8b": LLAMA_8B,
}
MAX_LEN = 2048


def random_runner(shape: str, slots: int, device: str, dtype: torch.dtype) -> ModelRunner:
    """A runner over a model of `shape` with random weights, built in place (no checkpoint on disk)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(SHAPES[shape]), max_positions=MAX_LEN)
    runner = ModelRunner(random_init(model, dtype, device), slots, MAX_LEN, device)
    if runner.device.type == "cuda":
        from eyas.engine.graphs import CudaGraphs

        runner.graphs = CudaGraphs(runner)
    return runner


def compare(runner: ModelRunner, rows: int, tokens: int, reps: int) -> dict:
    """Median ms of one prefill of `rows` prompts of `tokens` tokens, eager and in graphed chunks."""
    ids = torch.randint(0, runner.model.config.vocab_size, (rows, tokens), device=runner.device)
    slots = list(range(rows))
    rule = runner.prefills_in_chunks(rows, tokens)
    out = {"rows": rows, "tokens": tokens}
    for name, chunked in (("eager_ms", False), ("chunked_ms", True)):
        runner.chunked_prefill = chunked
        with torch.no_grad():
            out[name] = median_ms(lambda: runner.prefill(ids, slots), reps=reps)
    runner.chunked_prefill = None
    out["rule"] = "chunked" if rule else "eager"
    out["faster"] = "chunked" if out["chunked_ms"] < out["eager_ms"] else "eager"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", help=", ".join(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--rows", default="1,2,8,16", help="comma list of prompts per prefill")
    ap.add_argument("--tokens", default="64,128,256", help="comma list of prompt lengths")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "prefill.json")
    args = ap.parse_args(argv)
    try:
        if args.shape not in SHAPES:
            raise EyasError(f"unknown --shape {args.shape!r}: choose one of {', '.join(SHAPES)}")
        try:
            rows = [int(x) for x in args.rows.split(",")]
            tokens = [int(x) for x in args.tokens.split(",")]
        except ValueError:
            raise EyasError("--rows and --tokens take comma lists of integers") from None
        if min(rows + tokens) < 1 or max(tokens) > MAX_LEN // 2:
            raise EyasError(f"--rows and --tokens must be at least 1, and --tokens at most {MAX_LEN // 2}")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
            args.dtype or ("bf16" if args.device == "cuda" else "fp32"))
        if dtype is None:
            raise EyasError("--dtype is one of bf16, fp16, fp32")
        runner = random_runner(args.shape, max(rows), args.device, dtype)
        results = []
        for b in rows:
            for t in tokens:
                r = compare(runner, b, t, args.reps)
                results.append(r)
                print(json.dumps(r), flush=True)
        wrong = [r for r in results if r["rule"] != r["faster"]]
        print(f"{args.shape}: the rule picks the faster path in {len(results) - len(wrong)} of {len(results)} cases"
              + "".join(f"; {r['rows']}x{r['tokens']}: rule {r['rule']}, {r['faster']} faster "
                        f"({r['eager_ms']:.2f} vs {r['chunked_ms']:.2f} ms eager/chunked)" for r in wrong))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        args.out.write_text(json.dumps({"argv": sys.argv, "device": device, "torch": torch.__version__,
                                        "results": results}, indent=1))
    except EyasError as e:
        print(f"bench_prefill: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
