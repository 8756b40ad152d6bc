"""The training data's tokenization (the vocab stage's first pass): one tokenizer call per conversation
against `encode_all`'s batched calls, on the same conversations, with the results checked to be identical.

    python3 benchmarks/bench_tokenize.py [--model demo|HF_DIR] [--conversations 4000] [--chunk 1024]

The conversations are built from the bundled MT-bench and HumanEval questions: a question as the user turn
and 40-300 words of other questions as the reply (about the length of the recipe's replies). Both paths
render the chat template the same way; what differs is how the rendered texts are tokenized.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from eyas.errors import EyasError
from eyas.models.demo import demo_model_path
from eyas.models.tokenizer import load_tokenizer
from eyas.train.conversation import encode_all, encode_conversation, trainable
from eyas.train.prompts import Conversation, eval_texts


def conversations(n: int, seed: int = 0) -> list[Conversation]:
    texts, rng = eval_texts(["mt-bench", "humaneval"]), random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(" ".join(rng.choice(texts).split()) for _ in range(3)).split()[: rng.randint(40, 300)]
        out.append(Conversation(str(i), [{"role": "user", "content": texts[i % len(texts)]},
                                         {"role": "assistant", "content": " ".join(words)}]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="'demo' or an HF directory with a tokenizer")
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--chunk", type=int, default=1024, help="conversations per batched tokenizer call")
    ap.add_argument("--max-len", type=int, default=1024)
    args = ap.parse_args(argv)
    try:
        if args.conversations < 1 or args.chunk < 1:
            raise EyasError("--conversations and --chunk must be at least 1")
        tok = load_tokenizer(demo_model_path() if args.model == "demo" else args.model)
        convs = conversations(args.conversations)
        t0 = time.perf_counter()
        one = [encode_conversation(tok, c.messages, args.max_len) for c in convs]
        t_one = time.perf_counter() - t0
        t0 = time.perf_counter()
        batched, stats = encode_all(tok, convs, args.max_len, progress=False, chunk=args.chunk)
        t_batched = time.perf_counter() - t0
        kept = [s for s in one if trainable(s)]
        same = len(kept) == len(batched) and all(
            a.input_ids.equal(b.input_ids) and a.loss_mask.equal(b.loss_mask) for a, b in zip(kept, batched))
        if not same:
            raise EyasError("the batched tokenization differs from the per-conversation one")
        print(json.dumps({"conversations": len(convs), "tokens": stats["tokens"], "cpus": os.cpu_count(),
                          "per_conversation_s": round(t_one, 3), "batched_s": round(t_batched, 3),
                          "speedup": round(t_one / t_batched, 2), "same_samples": True}))
    except EyasError as e:
        print(f"bench_tokenize: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
