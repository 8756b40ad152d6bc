"""How well a draft guesses text it was or was not trained on: teacher-forced accuracy per draft step, and the
chain acceptance that accuracy implies, next to the acceptance the Engine measures.

Usage: python3 benchmarks/bench_draft_accuracy.py --draft assets/smollm2-135m-eagle3 [--dataset mt-bench|humaneval|FILE]
           [--conversations out/RUN/data/regen.jsonl] [--prompts 32] [--max-tokens 256] [--device cpu] [--out FILE]

Prompts (`--dataset`): the target writes greedy replies with the chain (`--spec-steps`, topk 1) through the
Engine, which counts its verify passes; one teacher-forced pass of the target and the draft's TTT unroll over
the same text then gives each draft step's accuracy and the acceptance read off it (train/simulate.py), which
must equal the Engine's. Conversations (`--conversations`, ShareGPT or OpenAI-messages JSONL, e.g. a training
run's regenerated data): the same pass over the replies as written, without generating, for the accuracy the
draft has on its own training data.

The training log's `acc_k` is measured on training batches; against this script's numbers on held-out text it
shows how much of it carries over.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def texts_from_prompts(args, tokenizer, stop_ids) -> tuple[list[list[int]], list[int], dict]:
    """Prompt + greedy reply token lists, prompt lengths, and the Engine's own acceptance."""
    from eyas.bench.datasets import load_prompts
    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from eyas.models.tokenizer import encode_messages

    prompts = [encode_messages(tokenizer, p.messages) for p in load_prompts(args.dataset, args.prompts)]
    engine = Engine(args.model, dtype=args.dtype, device=args.device, draft=str(args.draft),
                    spec=SpecConfig(args.spec_steps, 1), max_batch=min(32, len(prompts)),
                    max_len=max(map(len, prompts)) + args.max_tokens + 16)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, stop_token_ids=stop_ids))
    generated = sum(len(s.output_ids) - 1 for s in seqs)
    passes = sum(s.verify_passes for s in seqs)
    engine_side = {"accept_length": generated / max(1, passes), "generated": generated, "passes": passes,
                   "seconds": round(time.perf_counter() - t0, 2)}
    del engine
    return [p + s.output_ids for p, s in zip(prompts, seqs)], [len(p) for p in prompts], engine_side


def texts_from_conversations(args, tokenizer) -> tuple[list[list[int]], list[int]]:
    """First-turn conversations as written: the prompt is everything before the first assistant token."""
    from eyas.train.conversation import encode_conversation
    from eyas.train.prompts import read_conversations

    texts, starts = [], []
    for conv in read_conversations(args.conversations):
        sample = encode_conversation(tokenizer, conv.messages, args.max_len)
        first = sample.loss_mask.nonzero()
        if not len(first) or int(first[0]) < 1:
            continue
        end = int(first[-1]) + 1
        texts.append(sample.input_ids[:end].tolist())
        starts.append(int(first[0]))
        if len(texts) == args.prompts:
            break
    return texts, starts


@torch.no_grad()
def measure(args) -> dict:
    from eyas.models.demo import resolve_model_path
    from eyas.models.draft_io import load_draft
    from eyas.models.loader import load_model, parse_dtype
    from eyas.models.tokenizer import load_tokenizer
    from eyas.train.conversation import end_of_turn_ids
    from eyas.train.simulate import draft_predictions, simulate_chain, teacher_forced_accuracy
    from eyas.train.target import run_target

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    engine_side = None
    if args.conversations:
        texts, starts = texts_from_conversations(args, tokenizer)
        if not texts:
            raise SystemExit(f"bench_draft_accuracy: error: {args.conversations} holds no conversation with an "
                             "assistant reply after a prompt")
    else:
        from eyas.config import ModelConfig

        stop_ids = end_of_turn_ids(tokenizer, ModelConfig.from_dir(resolve_model_path(args.model)).eos_token_ids)
        texts, starts, engine_side = texts_from_prompts(args, tokenizer, stop_ids)

    target = load_model(args.model, args.dtype, args.device, max_positions=max(map(len, texts)) + 8)
    draft = load_draft(args.draft, target.config, dtype=parse_dtype(args.dtype), device=args.device)
    target.capture_layers = draft.config.capture_layers(target.config.num_layers)
    steps = max(args.spec_steps, args.accuracy_steps)
    right, total = [0] * steps, [0] * steps
    generated = passes = 0
    for ids, start in zip(texts, starts):
        ids_t = torch.tensor(ids, device=args.device)
        features = run_target(target, ids_t[None]).features
        preds = draft_predictions(draft, target.model.embed_tokens(ids_t[None]), features, steps)[:, 0]
        g, p = simulate_chain(preds, ids_t, start, args.spec_steps)
        generated, passes = generated + g, passes + p
        r, t = teacher_forced_accuracy(preds, ids_t, start)
        right = [a + b for a, b in zip(right, r)]
        total = [a + b for a, b in zip(total, t)]
    return {"draft": str(args.draft), "model": args.model, "device": args.device, "dtype": args.dtype,
            "source": str(args.conversations or args.dataset), "texts": len(texts), "reply_tokens": total[0],
            "spec_steps": args.spec_steps, "accuracy_k": [round(a / max(1, b), 4) for a, b in zip(right, total)],
            "simulated_accept_length": generated / max(1, passes), "engine": engine_side}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", type=Path, default=REPO / "assets" / "smollm2-135m-eagle3")
    p.add_argument("--model", default="demo", help="target: HF checkpoint directory or 'demo' (default)")
    p.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval, or a JSONL of prompts")
    p.add_argument("--conversations", type=Path, help="score these conversations' replies as written instead")
    p.add_argument("--prompts", type=int, default=32, help="prompts or conversations to use (default 32)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply budget when generating (default 256)")
    p.add_argument("--max-len", type=int, default=1024, help="conversation tokens kept (default 1024)")
    p.add_argument("--spec-steps", type=int, default=3, help="chain depth of the Engine and the simulation")
    p.add_argument("--accuracy-steps", type=int, default=7, help="draft steps whose accuracy is reported")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: bf16 on CUDA, else fp32")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.prompts < 1 or args.spec_steps < 1 or args.accuracy_steps < 1:
        print("bench_draft_accuracy: error: --prompts, --spec-steps and --accuracy-steps must be at least 1",
              file=sys.stderr)
        return 2
    from eyas.errors import EyasError

    try:
        result = measure(args)
    except (EyasError, OSError) as e:
        print(f"bench_draft_accuracy: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
