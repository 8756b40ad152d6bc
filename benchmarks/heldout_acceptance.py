"""A draft's acceptance length on every held-out prompt set, for each speculative setting, through the Engine.

Usage: python3 benchmarks/heldout_acceptance.py --draft assets/smollm2-135m-eagle3 [--other-draft DIR]
           [--sets mt-bench,humaneval,sharegpt,python-faq] [--prompts 16] [--new-tokens 128]
           [--specs 3/1/4,5/4/8] [--device cpu] [--dtype fp32] [--markdown FILE]

Acceptance length = generated tokens per target verify pass (SGLang's definition), greedy, over `--prompts`
prompts of each set drawn with a fixed seed. HumanEval, ShareGPT and the Python FAQ never chose a recipe
setting (MT-bench's acceptance did), and the recipe's overlap filter keeps all four out of training data.
With `--other-draft` both drafts run on the same prompts, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import md_tables

SETS = ("mt-bench", "humaneval", "sharegpt", "python-faq")


def parse_spec(text: str):
    from eyas.config import SpecConfig

    try:
        steps, topk, tokens = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"heldout_acceptance: error: --specs takes STEPS/TOPK/DRAFT_TOKENS items, got {text!r}")
    return SpecConfig(steps, topk, tokens, adaptive=False)


def acceptance(model, draft, spec, prompts, args, stop_ids) -> dict:
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams

    engine = Engine(model, dtype=args.dtype, device=args.device, draft=str(draft), spec=spec,
                    max_batch=min(16, len(prompts)), max_len=max(map(len, prompts)) + args.new_tokens + 24)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens, stop_token_ids=stop_ids))
    generated = sum(len(s.output_ids) - 1 for s in seqs)
    passes = sum(s.verify_passes for s in seqs)
    return {"accept_length": round(generated / max(1, passes), 3), "generated": generated, "passes": passes,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="the draft directory to measure")
    p.add_argument("--other-draft", help="a second draft measured on the same prompts (e.g. the previous one)")
    p.add_argument("--model", default="demo", help="the target (default: the demo model)")
    p.add_argument("--sets", default=",".join(SETS), help="comma-separated prompt sets")
    p.add_argument("--prompts", type=int, default=16, help="prompts per set (seeded sample)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--specs", default="3/1/4,5/4/8", help="comma-separated STEPS/TOPK/DRAFT_TOKENS settings")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16")
    p.add_argument("--markdown", help="write the table to this markdown file")
    p.add_argument("--json", help="write every measurement to this JSON file")
    args = p.parse_args(argv)
    if args.markdown:
        md_tables.writable(args.markdown, "heldout_acceptance")
    specs = [parse_spec(s) for s in args.specs.split(",")]
    drafts = [Path(d) for d in (args.draft, args.other_draft) if d]
    for d in drafts:
        if not (d / "config.json").is_file():
            raise SystemExit(f"heldout_acceptance: error: {d} is not a draft directory (no config.json)")
    sets = args.sets.split(",")
    unknown = [s for s in sets if s not in SETS]
    if unknown or args.prompts < 1 or args.new_tokens < 1:
        raise SystemExit(f"heldout_acceptance: error: sets must be among {', '.join(SETS)} and --prompts / "
                         f"--new-tokens positive (got {', '.join(unknown) or 'bad counts'})")

    from eyas.bench.datasets import load_prompts
    from eyas.config import ModelConfig
    from eyas.models.demo import resolve_model_path
    from eyas.models.tokenizer import encode_messages, load_tokenizer
    from eyas.train.conversation import end_of_turn_ids

    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    stop_ids = end_of_turn_ids(tokenizer, ModelConfig.from_dir(model_dir).eos_token_ids)
    results, rows = [], []
    for name in sets:
        prompts = [encode_messages(tokenizer, q.messages) for q in load_prompts(name, args.prompts, seed=0)]
        row = [name, len(prompts)]
        for spec in specs:
            for d in drafts:
                r = acceptance(args.model, d, spec, prompts, args, stop_ids)
                r.update(set=name, draft=str(d), spec=f"{spec.steps}/{spec.topk}/{spec.draft_tokens}")
                results.append(r)
                row.append(r["accept_length"])
                print(json.dumps(r), flush=True)
        rows.append(row)
    headers = ["set", "prompts"] + [f"{s.steps}/{s.topk}/{s.draft_tokens} {d.name}" for s in specs for d in drafts]
    text = md_tables.table(headers, rows, right=set(range(1, len(headers))))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(md_tables.run_header(args.device) + "\n" + text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
