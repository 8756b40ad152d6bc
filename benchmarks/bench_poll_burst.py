"""How long a stage boundary of the persistent step takes, alone: one producer stores N epoch-tagged words,
P - 1 consumers poll all N of them (eyas.kernels.persistent_words.await_both, the step's own poll).

Usage: python benchmarks/bench_poll_burst.py [--words 576,2304,6144] [--programs 2,10,37,97,132] [--launches 40]
       [--nap] [--device cpu]

In each launch, program 0 waits DELAY us (so that every consumer is polling), stores the N words with the
launch's epoch and stamps %globaltimer; every other program polls the words until all carry the epoch, then
stamps. The boundary is the consumers' stamps less the producer's, in us: the mean over consumers and
launches, and the mean of each launch's slowest consumer (a stage waits for its last item). N is one row of
a stage's input times the rows: 576 (a residual row), 1,536 (an activation row), times 1, 4 or 8. If the
boundary grows with N at P = 2, one program's read of more words costs it; if it grows with P at a given N,
the consumers reading the same words at once do. --device cpu runs Triton's interpreter (programs one after
another, no timer): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import os
import sys

DELAY_US = 20.0


def run(args) -> list[dict]:
    import torch
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from poll_burst_kernel import burst_kernel as kernel  # benchmarks/poll_burst_kernel.py

    dev = torch.device(args.device)
    out = []
    for n in args.words:
        half = triton.next_power_of_2(n) // 2 if n > 1 else 1
        for p in args.programs:
            words = torch.zeros(2 * half, dtype=torch.int64, device=dev)
            stamps = torch.zeros(p, dtype=torch.int64, device=dev)
            sink = torch.zeros(p, dtype=torch.float32, device=dev)
            mean, slowest = [], []
            expected = n * (n - 1) / 2  # word i holds i + the epoch
            for launch in range(args.launches + 2):  # the first two compile and warm up
                ep = launch + 1
                kernel[(p,)](words, stamps, sink, n, ep, int(DELAY_US * 1e3), HALF=half, NAP=args.nap)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                got = sink[1:].double()
                if not torch.allclose(got, torch.full_like(got, expected + n * ep)):
                    raise SystemExit(f"bench_poll_burst: consumers read stale words at N={n}, P={p}")
                if launch >= 2 and p > 1:
                    late = (stamps[1:] - stamps[0]).double() / 1e3
                    mean.append(float(late.mean()))
                    slowest.append(float(late.max()))
            out.append(dict(words=n, programs=p, launches=len(mean),
                            mean_us=sum(mean) / len(mean) if mean else float("nan"),
                            slowest_us=sum(slowest) / len(slowest) if slowest else float("nan")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", default="576,2304,4608,1536,6144,12288")
    ap.add_argument("--programs", default="2,10,37,97,132", help="launched programs: one producer, the rest poll")
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--nap", action="store_true", help="sleep 100 ns between poll rounds (a 1-row step's polls)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    try:
        args.words = [int(w) for w in args.words.split(",")]
        args.programs = [int(p) for p in args.programs.split(",")]
        if min(args.words) < 1 or min(args.programs) < 1 or args.launches < 1:
            raise ValueError
    except ValueError:
        print("bench_poll_burst: error: --words and --programs take comma-separated positive integers, "
              "--launches a positive one", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "1" if args.device == "cpu" else "0")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("bench_poll_burst: error: no CUDA device (--device cpu runs the smoke test)", file=sys.stderr)
            return 2
    rows = run(args)
    print(f"\n| words | programs | launches | consumers see all words after the store, mean us | slowest consumer, "
          f"mean us |\n| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['words']} | {r['programs']} | {r['launches']} | {r['mean_us']:.2f} | {r['slowest_us']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
