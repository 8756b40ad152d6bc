"""How long `eyas serve` takes from its command to a 200 from /health, for one or more source trees side by side.

    python3 benchmarks/bench_serve_start.py --model DIR [--tp 1] [--rounds 5] [--trees old=/tmp/old/src,new=src]

Each round starts one server per tree, one after the other (the order flips every round), on a free port,
times the first 200 from /health, then stops it with SIGTERM and waits for it to exit. A tree is a `src`
folder put first on PYTHONPATH (unpack an older commit with `git archive COMMIT src | tar -x -C /tmp/old`);
without --trees the installed eyas runs. Reported per tree: the median, fastest and slowest start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTUP_LIMIT_S = 300.0


class BenchError(Exception):
    """Bad input, or a server that did not come up: one line on stderr, exit 2."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0) as r:
            return r.status == 200
    except OSError:
        return False


def start_once(model: str, tp: int, src: str | None, device: str) -> float:
    """Seconds from the command to the first 200 from /health; the server is stopped before returning."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = free_port()
    cmd = [sys.executable, "-m", "eyas.cli", "serve", "--model", model, "--tp", str(tp), "--port", str(port),
           "--device", device]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        while not healthy(port):
            if proc.poll() is not None:
                raise BenchError(f"the server exited with code {proc.returncode}: "
                                 f"{(proc.stderr.read().strip().splitlines() or ['(no output)'])[-1]}")
            if time.perf_counter() - start > STARTUP_LIMIT_S:
                raise BenchError(f"no 200 from /health within {STARTUP_LIMIT_S:g} s")
            time.sleep(0.02)
        return time.perf_counter() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def parse_trees(text: str) -> list[tuple[str, str | None]]:
    if not text:
        return [("installed", None)]
    trees = []
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise BenchError(f"--trees item {item!r} is not NAME=SRC_DIR")
        if not (Path(path) / "eyas" / "cli.py").is_file():
            raise BenchError(f"{path} has no eyas/cli.py (want a tree's src folder)")
        trees.append((name, str(Path(path).resolve())))
    return trees


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory, or 'demo'")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trees", default="", help="NAME=SRC_DIR,... (default: the installed eyas)")
    ap.add_argument("--out", default=None, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except BenchError as e:
        print(f"bench_serve_start: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.rounds < 1 or args.tp < 1:
        raise BenchError("--rounds and --tp must be at least 1")
    if args.model != "demo" and not Path(args.model).is_dir():
        raise BenchError(f"model directory {args.model} not found")
    trees = parse_trees(args.trees)
    times: dict[str, list[float]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, src in (trees if r % 2 == 0 else trees[::-1]):
            times[name].append(start_once(args.model, args.tp, src, args.device))
            print(f"round {r + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    rows = []
    for name, _ in trees:
        got = times[name]
        rows.append(dict(tree=name, median_s=round(statistics.median(got), 3), min_s=round(min(got), 3),
                         max_s=round(max(got), 3), rounds_s=[round(t, 3) for t in got]))
        print(f"{name:12s} median {statistics.median(got):.2f} s  fastest {min(got):.2f}  slowest {max(got):.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=args.model, tp=args.tp, device=args.device,
                                                  cpu_count=os.cpu_count(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
