"""Incremental detokenization cost per token: the tokenizer's decode() wrapper against its Rust backend.

The server decodes twice per token and request (detokenize.py), on the event loop's one core.

    python3 benchmarks/bench_detokenize.py [--model demo|HF_DIR] [--tokens 3000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eyas.errors import EyasError
from eyas.models.demo import demo_model_path
from eyas.models.tokenizer import load_tokenizer
from eyas.server.detokenize import Detokenizer, fast_decoder

REPO = Path(__file__).resolve().parents[1]


def per_token_us(tok, ids: list[int], decode, repeats: int = 3) -> tuple[float, str]:
    """Best of `repeats` runs of one Detokenizer fed token by token: microseconds per token, and the text."""
    best, text = float("inf"), ""
    for _ in range(repeats):
        d = Detokenizer(tok, ids[:5], decode=decode)
        t0 = time.perf_counter()
        text = "".join(d.add([t]) for t in ids[5:]) + d.flush()
        best = min(best, (time.perf_counter() - t0) / (len(ids) - 5) * 1e6)
    return best, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="'demo' or an HF directory with a tokenizer")
    ap.add_argument("--tokens", type=int, default=3000, help="tokens of this repository's README to stream")
    args = ap.parse_args(argv)
    try:
        if args.tokens < 10:
            raise EyasError("--tokens must be at least 10")
        tok = load_tokenizer(demo_model_path() if args.model == "demo" else args.model)
        ids = tok.encode((REPO / "README.md").read_text(), add_special_tokens=False)[:args.tokens]
        wrapper, text_w = per_token_us(tok, ids, lambda x: tok.decode(x, skip_special_tokens=True))
        fast, text_f = per_token_us(tok, ids, fast_decoder(tok))
        if text_w != text_f:
            raise EyasError("the two decoders gave different text")
        print(json.dumps({"tokens": len(ids) - 5, "wrapper_us_per_token": round(wrapper, 2),
                          "fast_us_per_token": round(fast, 2), "same_text": True}))
    except EyasError as e:
        print(f"bench_detokenize: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
