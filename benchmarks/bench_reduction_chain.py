"""What one cross-warp reduction costs inside a program of the persistent step's width: a chain of N dependent
reductions over a [BLOCK] fp32 tensor spread over the program's warps, each result fed back into the tensor so
that the next must wait for it, one program on every SM, timed with %globaltimer around the chain.

Usage: python benchmarks/bench_reduction_chain.py [--blocks 256,1024,2048] [--chain 200] [--warps 8]

`sum` chains one tl.sum a round; `max, sum` chains a softmax's two (a max, then the sum of exponentials
against it), reported per reduction. Prints a markdown table: the median over programs of (chain time / number
of reductions), and the slowest program's. An item's work after its poll is a sequence of such reductions (an
rmsnorm, a product's chunks summed, a softmax), so this prices the dependent ones. Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys


def _chain_kernel():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    @triton.jit
    def chain(x_ptr, out_ptr, stamps_ptr, N: tl.constexpr, BLOCK: tl.constexpr, SOFTMAX: tl.constexpr):
        """N rounds, each waiting on the last: one tl.sum, or with SOFTMAX a max and a sum of exponentials."""
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        start = globaltimer()
        for _ in range(N):
            if SOFTMAX:
                x = x + tl.sum(tl.exp(x - tl.max(x))) * 1e-9
            else:
                x = x + tl.sum(x) * 1e-9
        end = globaltimer()
        tl.store(out_ptr + pid * BLOCK + offs, x)
        tl.store(stamps_ptr + 2 * pid, start)
        tl.store(stamps_ptr + 2 * pid + 1, end)

    return chain


def run(args) -> list[dict]:
    import torch

    programs = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = _chain_kernel()
    rows = []
    for name, softmax, per_round in (("sum", False, 1), ("max, sum", True, 2)):
        for block in args.blocks:
            x = torch.randn(block, device="cuda") * 1e-3
            out = torch.empty(programs * block, device="cuda")
            stamps = torch.zeros(2 * programs, dtype=torch.int64, device="cuda")
            for _ in range(3):  # the first compiles; the last is read
                kernel[(programs,)](x, out, stamps, N=args.chain, BLOCK=block, SOFTMAX=softmax, num_warps=args.warps)
            torch.cuda.synchronize()
            ns = (stamps[1::2] - stamps[0::2]).double() / (args.chain * per_round)
            rows.append(dict(reduction=name, block=block, median_ns=ns.median().item(), max_ns=ns.max().item(),
                             programs=programs))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="256,1024,2048", help="comma-separated powers of two: the tensor's length")
    ap.add_argument("--chain", type=int, default=200, help="reduction rounds a program runs in turn")
    ap.add_argument("--warps", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        args.blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        print(f"bench_reduction_chain: error: --blocks {args.blocks!r}: expected comma-separated integers",
              file=sys.stderr)
        return 2
    if any(b < 16 or b & (b - 1) for b in args.blocks) or args.chain < 1 or args.warps < 1:
        print("bench_reduction_chain: error: --blocks must be powers of two of at least 16, --chain and --warps "
              "at least 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench_reduction_chain: error: it times %globaltimer on a GPU; none is visible", file=sys.stderr)
        return 2
    rows = run(args)
    gpu = torch.cuda.get_device_name(0)
    print(f"{gpu}, {rows[0]['programs']} programs of {args.warps} warps, chains of {args.chain}\n")
    print("| reduction | block | ns a reduction (median over programs) | slowest program |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['reduction']} | {r['block']} | {r['median_ns']:.1f} | {r['max_ns']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
