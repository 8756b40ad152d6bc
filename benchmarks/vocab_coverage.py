"""How much of an evaluation set's reply text a draft vocabulary covers, by size and by how it is chosen.

Usage: python3 benchmarks/vocab_coverage.py --conversations RUN/data/regen-r0.jsonl [--dataset mt-bench]
           [--prompts 80] [--new-tokens 256] [--sizes 8192,12288,16384] [--device cpu] [--out FILE]

The target writes greedy replies to the evaluation prompts (plain decoding, no draft). The training
conversations are tokenized as `eyas train vocab` tokenizes them, and for each size the vocabulary is chosen
  - `assistant`: the most frequent assistant tokens (the recipe's choice, eyas.train.vocab);
  - `assistant+user`: the most frequent tokens of the assistant and user turns together, since replies echo
    the question's topic words, and these are what the draft vocabulary misses most on MT-bench.
Each vocabulary's coverage of the evaluation replies' tokens is the share a chain could ever guess: a token
outside it ends every chain that reaches it (diagnose_acceptance.py's vocabulary oracle says what the misses
cost a trained draft). Its coverage of the training replies is listed beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from diagnose_acceptance import run_and_report  # benchmarks/diagnose_acceptance.py (the script's folder is on sys.path)


def evaluation_replies(args, model_dir: str, tokenizer) -> list[list[int]]:
    """The target's greedy replies (token ids) to the evaluation prompts."""
    from eyas.bench.datasets import load_prompts
    from eyas.config import ModelConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from eyas.models.tokenizer import encode_messages
    from eyas.train.conversation import end_of_turn_ids

    prompts = [encode_messages(tokenizer, p.messages) for p in load_prompts(args.dataset)[: args.prompts]]
    stop_ids = end_of_turn_ids(tokenizer, ModelConfig.from_dir(model_dir).eos_token_ids)
    engine = Engine(args.model, dtype=args.dtype, device=args.device, max_batch=min(32, len(prompts)),
                    max_len=max(map(len, prompts)) + args.new_tokens + 16)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens, stop_token_ids=stop_ids))
    return [s.output_ids for s in seqs]


def training_counts(args, tokenizer, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token counts over the training conversations' assistant tokens and over their user turns, and how many
    conversations were read."""
    from eyas.train.conversation import encode_all
    from eyas.train.prompts import read_conversations
    from eyas.train.vocab import count_tokens

    convs = read_conversations(args.conversations)
    samples, _ = encode_all(tokenizer, convs, args.max_len, progress=False)
    assistant = count_tokens(samples, vocab_size)
    turns = [t for c in convs for t in c.user_turns()]
    user = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(turns), 4096):  # batched: the fast tokenizer spreads a batch over the cores
        ids = [x for row in tokenizer(turns[i: i + 4096], add_special_tokens=False)["input_ids"] for x in row]
        user += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return assistant, user, len(convs)


def coverage(args) -> dict:
    from eyas.config import ModelConfig
    from eyas.models.demo import resolve_model_path
    from eyas.models.tokenizer import load_tokenizer
    from eyas.train.vocab import mapping_from_counts

    t0 = time.perf_counter()
    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    assistant, user, conversations = training_counts(args, tokenizer, vocab_size)
    replies = evaluation_replies(args, model_dir, tokenizer)
    eval_ids = torch.tensor([t for r in replies for t in r], dtype=torch.long)
    rows = []
    for size in args.sizes:
        for source, counts in (("assistant", assistant), ("assistant+user", assistant + user)):
            t2d = mapping_from_counts(counts, size).t2d
            trained = float(assistant[t2d].sum()) / max(1, int(assistant.sum()))
            evaluated = float(t2d[eval_ids].float().mean())
            rows.append(dict(size=size, source=source, evaluation_coverage=round(evaluated, 4),
                             training_reply_coverage=round(trained, 4)))
    return {"conversations": conversations, "evaluation_replies": len(replies), "evaluation_tokens": eval_ids.numel(),
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=Path, required=True,
                   help="training conversations (ShareGPT or OpenAI-messages JSONL)")
    p.add_argument("--model", default="demo", help="target: HF checkpoint directory or 'demo' (default)")
    p.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval, or a JSONL of prompts")
    p.add_argument("--prompts", type=int, default=80, help="evaluation prompts (default 80)")
    p.add_argument("--new-tokens", type=int, default=256, help="reply budget (default 256)")
    p.add_argument("--max-len", type=int, default=1024, help="conversation tokens kept, as the recipe's (default 1024)")
    p.add_argument("--sizes", default="8192,12288,16384", help="draft vocabulary sizes (comma-separated)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--out", type=Path, help="JSON results (also printed)")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        args.sizes = []
    if not args.sizes or min(args.sizes + [args.prompts, args.new_tokens]) < 1:
        print("vocab_coverage: error: --sizes (comma-separated integers), --prompts and --new-tokens must be at "
              "least 1", file=sys.stderr)
        return 2
    return run_and_report("vocab_coverage", coverage, args)


if __name__ == "__main__":
    sys.exit(main())
