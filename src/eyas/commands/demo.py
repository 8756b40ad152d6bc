"""eyas demo: the embedded SmolLM2 target, plain and with its trained EAGLE-3 draft, side by side.

Usage: eyas demo [--device cpu|cuda] [--max-tokens 96]
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
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--max-tokens", type=int, default=96)


def run(args) -> int:
    import torch

    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from eyas.models.demo import demo_model_path
    from eyas.models.tokenizer import encode_prompt, load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if device == "cuda" else "fp32"
    path = demo_model_path()
    print(f"demo target: SmolLM2-135M-Instruct at {path} ({device}, {dtype})")
    tok = load_tokenizer(path)
    prompts = [encode_prompt(tok, q, chat=True) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens)
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
    return 0
