"""How long `eyas serve` takes from its command to a 200 from /health, for one or more source trees side by side.

    python3 benchmarks/bench_serve_start.py --model DIR [--tp 1] [--rounds 5] [--trees old=/tmp/old/src,new=src]

Each round starts one server per tree, one after the other (the order flips every round), on a free port,
times the first 200 from /health (and the /server_info request that bench_serve_load's Server makes right
after it, milliseconds on localhost), then stops it with SIGTERM and waits for it to exit. A tree is a `src`
folder put first on PYTHONPATH (unpack an older commit with `git archive COMMIT src | tar -x -C /tmp/old`);
without --trees the installed eyas runs. Reported per tree: the median, fastest and slowest start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_serve_load import Server  # benchmarks/ (the script's own folder is on sys.path)
from eyas.dist.launch import free_port
from eyas.errors import EyasError

STARTUP_LIMIT_S = 300.0
POLL_S = 0.02  # between /health requests: the start's resolution


def start_once(model: str, tp: int, src: str | None, device: str, log_path: Path) -> float:
    """Seconds from the command to the first 200 from /health; the server is stopped before returning."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = free_port()
    argv = [sys.executable, "-m", "eyas.cli", "serve", "--model", model, "--tp", str(tp), "--port", str(port),
            "--device", device]
    start = time.perf_counter()
    server = Server(log_path.stem, argv, port, log_path, env=env)
    try:
        server.wait_healthy(STARTUP_LIMIT_S, poll_s=POLL_S)
        return time.perf_counter() - start
    finally:
        server.stop()


def parse_trees(text: str) -> list[tuple[str, str | None]]:
    if not text:
        return [("installed", None)]
    trees = []
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise EyasError(f"--trees item {item!r} is not NAME=SRC_DIR")
        if not (Path(path) / "eyas" / "cli.py").is_file():
            raise EyasError(f"{path} has no eyas/cli.py (want a tree's src folder)")
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
    except EyasError as e:
        print(f"bench_serve_start: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.rounds < 1 or args.tp < 1:
        raise EyasError("--rounds and --tp must be at least 1")
    if args.model != "demo" and not Path(args.model).is_dir():
        raise EyasError(f"model directory {args.model} not found")
    trees = parse_trees(args.trees)
    times: dict[str, list[float]] = {name: [] for name, _ in trees}
    logs = Path(tempfile.mkdtemp(prefix="bench_serve_start-"))
    for r in range(args.rounds):
        for name, src in (trees if r % 2 == 0 else trees[::-1]):
            times[name].append(start_once(args.model, args.tp, src, args.device, logs / f"{name}-{r + 1}.log"))
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
