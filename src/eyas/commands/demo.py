"""eyas demo: the embedded SmolLM2 target, plain and with its trained EAGLE-3 draft, side by side.

Usage: eyas demo [--device cpu|cuda] [--max-tokens 96] [--no-bench]

It ends by launching `eyas serve` twice (without and with the draft), benchmarking each on MT-bench prompts,
and recording both runs in the ledger, where `eyas runs list/show/diff` find them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

QUESTIONS = ["Write a short poem about a young hawk learning to fly.",
             "Explain in three sentences why the sky is blue."]


def bundled_draft() -> Path | None:
    """The demo draft shipped in the repository's assets/ (or $EYAS_DEMO_DRAFT)."""
    env = os.environ.get("EYAS_DEMO_DRAFT")
    if env:
        return Path(env)
    path = Path(__file__).resolve().parents[3] / "assets" / "smollm2-135m-eagle3"
    return path if (path / "config.json").exists() else None


def add_arguments(p):
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default 96)")
    p.add_argument("--no-bench", action="store_true", help="skip the recorded server benchmark at the end")
    p.add_argument("--bench-prompts", type=int, default=4, help="MT-bench prompts per recorded benchmark run")
    p.add_argument("--port", type=int, default=8431, help="port of the servers the recorded benchmark starts")


def run(args) -> int:
    import torch

    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from eyas.models.demo import demo_model_path
    from eyas.models.tokenizer import encode_prompt, load_tokenizer

    from eyas.errors import EyasError

    # Checked before the demo's generation, which takes a while, rather than when the bench starts after it.
    if args.device == "cuda" and not torch.cuda.is_available():
        raise EyasError("--device cuda was asked for but no CUDA device is available")
    params = SamplingParams(max_tokens=args.max_tokens)
    if not args.no_bench and args.bench_prompts < 1:
        raise EyasError(f"--bench-prompts must be >= 1, got {args.bench_prompts}")
    if not args.no_bench and not 1 <= args.port <= 65535:
        raise EyasError(f"--port must be in 1..65535, got {args.port}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if device == "cuda" else "fp32"
    path = demo_model_path()
    print(f"demo target: SmolLM2-135M-Instruct at {path} ({device}, {dtype})")
    tok = load_tokenizer(path)
    prompts = [encode_prompt(tok, q, chat=True) for q in QUESTIONS]
    draft = bundled_draft()
    runs = [("plain", None, None)]
    if draft is not None:
        runs.append(("EAGLE-3 chain 3/1/4", str(draft), SpecConfig(3, 1)))
    else:
        print("no bundled draft found in assets/; running the plain target only", file=sys.stderr)
    outputs = {}
    for name, d, spec in runs:
        engine = Engine(str(path), dtype=dtype, device=device, draft=d, spec=spec, max_batch=1, max_len=1024)
        t0 = time.perf_counter()
        seqs = [engine.generate([p], params)[0] for p in prompts]
        secs = time.perf_counter() - t0
        toks = sum(len(s.output_ids) for s in seqs)
        outputs[name] = [s.output_ids for s in seqs]
        acc = ""
        if spec:
            passes = sum(s.verify_passes for s in seqs)
            acc = f", acceptance length {(toks - len(seqs)) / max(passes, 1):.2f}"
        print(f"\n== {name}: {toks} tokens in {secs:.2f} s ({toks / secs:.1f} tok/s{acc})")
        print(tok.decode(seqs[0].output_ids, skip_special_tokens=True))
    if len(outputs) == 2:
        same = outputs["plain"] == list(outputs.values())[1]
        print(f"\nspeculative output identical to plain greedy output: {same}")
    if not args.no_bench:
        recorded_bench(draft, device, args)
    return 0


def recorded_bench(draft: Path | None, device: str, args):
    """Serve the demo without and with its draft, bench each, record both in the ledger."""
    from eyas.runs.launch import launch, plan_for
    from eyas.runs.launch_host import LocalHost
    from eyas.runs.launch_spec import BenchSpec, LaunchSpec
    from eyas.runs.ledger import Ledger

    bench = BenchSpec(dataset="mt-bench", num_prompts=args.bench_prompts, concurrency=1, max_tokens=64)
    extra = ["--device", device]
    specs = [LaunchSpec(backend="eyas", model="demo", port=args.port, bench=bench, extra_args=extra)]
    if draft is not None:
        specs.append(LaunchSpec(backend="eyas", model="demo", draft=str(draft), spec_steps=3, spec_topk=1,
                                port=args.port, bench=bench, extra_args=extra))
    print("\n== recorded benchmark: eyas serve + eyas bench (MT-bench, "
          f"{args.bench_prompts} prompts, 64 tokens, concurrency 1)")
    ids = []
    host = LocalHost(None)
    with Ledger() as ledger:
        for spec in specs:
            outcome = launch(plan_for(spec, host), host, ledger, launched_by=["eyas", "demo"])
            r = outcome.results
            acc = r.get("accept_length")
            print(f"run {outcome.run_id}: {'with draft' if spec.draft else 'no draft'}: "
                  f"{r.get('output_tok_s', 0):.1f} output tok/s"
                  + (f", acceptance length {acc:.2f}" if acc else "") + ("" if outcome.ok else " (FAILED)"))
            ids.append(outcome.run_id)
    print("\nwhere to look: `eyas runs list`, `eyas runs show " + ids[-1] + "`"
          + (f", `eyas runs diff {ids[0]} {ids[-1]}`" if len(ids) == 2 else ""))
