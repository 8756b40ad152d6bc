"""The vocab stage's token count: one bincount per sample (the stage's earlier way) against
`count_tokens`'s one bincount over all samples, each timed alone and with other processes counting at once
(the training-arms runner starts one vocab stage per GPU on a shared host). The counts are checked equal.

    python3 benchmarks/bench_vocab_count.py [--samples 72000] [--procs 1,2] [--out vocab_count.json]

Samples are random: 100-500 tokens of a 49,152-token vocabulary (SmolLM2's), 80% of them loss-masked in.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
import time

import torch

from eyas.train.conversation import Sample
from eyas.train.vocab import count_tokens

VOCAB = 49152


def make_samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 500, (n,), generator=g).tolist()
    return [Sample(torch.randint(0, VOCAB, (k,), generator=g), torch.rand(k, generator=g) > 0.2) for k in lengths]


def count_per_sample(samples, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=vocab_size)
    return counts


WAYS = {"per_sample": count_per_sample, "count_tokens": count_tokens}


def _time_one(way: str, n: int, start, results):
    samples = make_samples(n)
    start.wait()
    t0 = time.perf_counter()
    counts = WAYS[way](samples, VOCAB)
    seconds = time.perf_counter() - t0
    results.put((seconds, int(counts.sum()), hashlib.sha256(counts.numpy().tobytes()).hexdigest()))


def timed(way: str, n: int, procs: int) -> dict:
    """`procs` processes count the same samples at the same moment; each one's time is reported."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_time_one, args=(way, n, start, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    got = [results.get() for _ in workers]
    for w in workers:
        w.join()
    return {"way": way, "procs": procs, "seconds": [round(t, 3) for t, _, _ in got],
            "total": got[0][1], "sha256": got[0][2]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=72000)
    ap.add_argument("--procs", default="1,2", help="comma-separated numbers of processes counting at once")
    ap.add_argument("--out", default="vocab_count.json")
    args = ap.parse_args(argv)
    try:
        procs = [int(p) for p in args.procs.split(",")]
        if args.samples < 1 or not procs or min(procs) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --samples must be >= 1 and --procs a list of numbers >= 1, got {args.procs!r}",
              file=sys.stderr)
        return 2
    rows = [timed(way, args.samples, p) for p in procs for way in WAYS]
    if len({r["sha256"] for r in rows}) != 1:
        print("error: the two ways counted differently", file=sys.stderr)
        return 1
    print(f"| processes | per-sample bincount s | count_tokens s | speedup |  ({args.samples} samples, "
          f"{torch.get_num_threads()} threads each)")
    print("| ---: | ---: | ---: | ---: |")
    for p in procs:
        a, b = (max(r["seconds"]) for r in rows if r["procs"] == p)
        print(f"| {p} | {a:.2f} | {b:.2f} | {a / b:.1f}x |")
    with open(args.out, "w") as f:
        json.dump({"samples": args.samples, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
