"""Serving under load: output tokens/s, TTFT and ITL at several concurrencies, `eyas serve` without and with the draft.

Usage: python3 benchmarks/bench_serve_load.py --out out/serve_load.json [--concurrency 1,4,16,64] [--configs plain,spec,adaptive] [--rounds 2]
       python3 benchmarks/bench_serve_load.py --device cpu --concurrency 1,2 --num-prompts 2 --max-tokens 8   (smoke run)

Each configuration gets its own real `eyas serve` subprocess (plain: no draft; spec: the draft, chain 3/1/4,
speculating at every step (--no-spec-adaptive); adaptive: the server default with a draft), started, waited on
until /health answers, measured at every concurrency with the `eyas bench` client (MT-bench, greedy, warm-up
left out), then stopped with SIGTERM. The markdown table puts every configuration beside the plain server at
the same concurrency and round: speculation must never be the slower one. With `--rounds N` the whole
sequence of servers runs N times, so that the spread between rounds shows how much of a difference is noise
(the host's state drifts between one server's run and the next's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from eyas.bench.client import run_benchmark
from eyas.bench.config import BenchConfig
from eyas.bench.prometheus import labeled_samples, parse_metrics
from eyas.dist.launch import free_port
from eyas.errors import EyasError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFT = REPO / "assets" / "smollm2-135m-eagle3"
CONFIGS = {  # name -> extra `eyas serve` flags; "{draft}" is filled in from --draft
    "plain": [],
    "spec": ["--draft", "{draft}", "--spec-steps", "3", "--spec-topk", "1", "--spec-draft-tokens", "4",
             "--no-spec-adaptive"],
    "adaptive": ["--draft", "{draft}", "--spec-steps", "3", "--spec-topk", "1", "--spec-draft-tokens", "4",
                 "--spec-adaptive"],
}
STOP_TIMEOUT_S = 60  # SIGTERM drains running requests; past this the server's process group is killed


def hardware(device: str) -> str:
    if device != "cpu":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"cpu ({os.cpu_count()} cores)"


class Server:
    """One `eyas serve` process in its own session, so a kill reaches its workers too."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
        self.name, self.url, self.log_path = name, f"http://127.0.0.1:{port}", log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EyasError(f"server '{self.name}' exited with code {self.proc.returncode} before /health "
                                    f"answered: {self.last_log_line()} (log: {self.log_path})")
                try:
                    if http.get("/health").status_code == 200:
                        return http.get("/server_info").json()
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(poll_s)
        raise EyasError(f"server '{self.name}' not healthy after {timeout_s:.0f} s (log: {self.log_path})")

    def last_log_line(self) -> str:
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else "no output"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the session (the server past its timeout, or workers of a server that died before it
        # could stop them) must not hold the GPU or the port for the next configuration.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def serve_argv(args, name: str, port: int) -> list[str]:
    extra = [a.replace("{draft}", str(args.draft)) for a in CONFIGS[name]]
    most = max(args.concurrency)
    argv = [sys.executable, "-m", "eyas.cli", "serve", "--model", args.model, "--port", str(port),
            "--device", args.device, "--max-running", str(max(args.max_running, most)),
            "--max-queue", str(max(64, most)), *extra]
    return argv + (["--dtype", args.dtype] if args.dtype else [])


def metrics_text(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def spec_steps(text: str) -> dict[str, float]:
    """The server's steps under a draft so far, by mode (`eyas_spec_steps_total`, summed over batch buckets)."""
    out = {"speculative": 0.0, "plain": 0.0}
    for labels, value in labeled_samples(text, "eyas_spec_steps_total"):
        out["speculative" if labels["mode"] == "speculative" else "plain"] += value
    return out


def policy_estimates(text: str) -> dict:
    """The adaptive policy's measured rates (`eyas_spec_rate_tokens_per_second`, tokens/s per running sequence)
    by batch bucket and mode, and the speed-up of speculation they show; {} without an adaptive policy."""
    rates = {}
    for labels, value in labeled_samples(text, "eyas_spec_rate_tokens_per_second"):
        rates.setdefault(int(labels["bucket"]), {})["spec" if labels["mode"] == "speculative" else "plain"] = value
    for r in rates.values():
        if "spec" in r and "plain" in r:
            r["gain"] = r["spec"] / r["plain"]
    return dict(sorted(rates.items()))


def policy_books(text: str) -> dict[str, dict[str, float]]:
    """What the adaptive policy charged to each mode so far: {"seconds": {mode: s}, "tokens": {mode: n}}
    (`eyas_spec_policy_seconds`, `eyas_spec_policy_tokens`; mode "void": windows with a graph capture)."""
    books = {}
    for kind in ("seconds", "tokens"):
        books[kind] = {labels["mode"]: value for labels, value in labeled_samples(text, f"eyas_spec_policy_{kind}")}
    return books


def engine_time(text: str) -> dict[str, float]:
    """Where the server's engine spent its time so far (`eyas_cycle_ms`, `eyas_joined_requests_total`):
    steps and their seconds, and of those the steps that prefilled joining requests, and how many joined."""
    out = dict.fromkeys(("steps", "step_s", "join_steps", "join_s", "joined"), 0.0)
    names = {"step": ("steps", "step_s"), "step_with_joins": ("join_steps", "join_s")}
    for suffix, scale, index in (("_count", 1.0, 0), ("_sum", 1e-3, 1)):
        for labels, value in labeled_samples(text, "eyas_cycle_ms" + suffix):
            if labels.get("phase") in names:
                out[names[labels["phase"]][index]] += value * scale
    out["joined"] = sum(parse_metrics(text).get("eyas_joined_requests_total", []))
    return out


def engine_line(e: dict[str, float], level_s: float, front_end_cpu_s: float | None = None) -> str:
    """One level's engine time in words (a difference of two engine_time readings), and the CPU time of the
    server's own process (HTTP, detokenization, the scheduler thread: the workers are other processes)."""
    plain_steps, plain_s = e["steps"] - e["join_steps"], e["step_s"] - e["join_s"]
    mean = lambda s, n: f"{s / n * 1e3:.2f} ms" if n else "-"  # noqa: E731
    front = "" if front_end_cpu_s is None else f"; the front end used {front_end_cpu_s:.2f} s of CPU"
    return (f"engine busy {e['step_s']:.2f} s of the level's {level_s:.2f} s: {plain_steps:.0f} steps without joins "
            f"({mean(plain_s, plain_steps)} each), {e['join_steps']:.0f} with joins ({mean(e['join_s'], e['join_steps'])} "
            f"each, {e['joined']:.0f} requests){front}")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process, all its threads, its children not included (Linux /proc);
    None where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def measure(args, server: Server, concurrency: int) -> dict:
    num_prompts = args.num_prompts or max(16, 4 * concurrency)
    # Warm-up fills the batch once, so CUDA graphs, allocator and the adaptive policy have seen this batch size.
    warmup = concurrency if args.warmup is None else args.warmup
    config = BenchConfig(url=server.url, dataset=args.dataset, num_prompts=num_prompts, concurrency=concurrency,
                         max_tokens=args.max_tokens, temperature=0.0, seed=args.seed, warmup=warmup, progress=False)
    text = metrics_text(server.url)
    before, books_before, engine_before = spec_steps(text), policy_books(text), engine_time(text)
    cpu_before = process_cpu_s(server.proc.pid)
    started = time.perf_counter()
    result = run_benchmark(config).to_dict()
    cpu_after = process_cpu_s(server.proc.pid)
    text = metrics_text(server.url)
    after, books_after, engine_after = spec_steps(text), policy_books(text), engine_time(text)
    result["level_s"] = time.perf_counter() - started  # warm-up requests included, as in the three below
    # Where the engine's time went, for every server: what separates the modes besides the steps themselves.
    result["engine"] = {k: engine_after[k] - engine_before[k] for k in engine_after}
    # The front end's CPU: near the level's wall time, one core is saturated and the GIL bounds the server.
    result["front_end_cpu_s"] = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    # What the server chose during this level: how the adaptive policy decided.
    result["spec_steps"] = {mode: after[mode] - before[mode] for mode in after}
    # The policy's books for this level: seconds charged and tokens produced per mode, to hold against
    # the level's wall time and against the rates the policy believed.
    result["policy_books"] = {kind: {m: v - books_before[kind].get(m, 0.0) for m, v in books_after[kind].items()}
                              for kind in books_after}
    result["policy"] = policy_estimates(text)  # what the adaptive policy believed at the level's end
    if not result["completed"]:
        raise EyasError(f"'{server.name}' at concurrency {concurrency}: every request failed, "
                        f"first with {next(iter(result['error_messages']), 'no message')}")
    return {"server": server.name, "concurrency": concurrency, **result}  # result["config"]: the client's


def ms(stats: dict | None) -> str:
    return "/".join(f"{stats[q]:.1f}" for q in ("p50", "p90", "p99")) if stats else "-"


def plain_rates(rows: list[dict]) -> dict[tuple[int, int], float]:
    """The plain server's output tok/s by (round, concurrency)."""
    return {(r.get("round", 1), r["concurrency"]): r["output_tok_s"] for r in rows if r["server"] == "plain"}


def table(rows: list[dict]) -> str:
    plain = plain_rates(rows)
    lines = ["| round | server | conc | prompts ok/err | out tok/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
             "| accept len | speculative steps | spec/plain |", "|" + "---|" * 11]
    for r in rows:
        base = plain.get((r.get("round", 1), r["concurrency"]))
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base and r["server"] != "plain" else "-"
        accept = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else "-"
        steps = r.get("spec_steps") or {}
        total = sum(steps.values())
        share = f"{steps['speculative'] / total:.0%} of {total:.0f}" if total else "-"
        lines.append(f"| {r.get('round', 1)} | {r['server']} | {r['concurrency']} | {r['completed']}/{r['errors']} | {r['output_tok_s']:.1f} "
                     f"| {r['request_s']:.2f} | {ms(r['ttft_ms'])} | {ms(r['itl_ms'])} | {accept} | {share} "
                     f"| {ratio} |")
    return "\n".join(lines)


def slower_than_plain(rows: list[dict]) -> list[str]:
    plain = plain_rates(rows)
    out = []
    for r in rows:
        key = (r.get("round", 1), r["concurrency"])
        if r["server"] != "plain" and key in plain and r["output_tok_s"] < plain[key]:
            out.append(f"{r['server']} at concurrency {r['concurrency']} in round {key[0]} "
                       f"({r['output_tok_s'] / plain[key]:.2f}x)")
    return out


def spread(rows: list[dict]) -> list[str]:
    """Per server and concurrency, the range of its ratio to plain over the rounds (with more than one)."""
    plain, ratios = plain_rates(rows), {}
    for r in rows:
        key = (r.get("round", 1), r["concurrency"])
        if r["server"] != "plain" and key in plain:
            ratios.setdefault((r["server"], r["concurrency"]), []).append(r["output_tok_s"] / plain[key])
    return [f"{server} at {c}: {min(v):.2f}x-{max(v):.2f}x over {len(v)} rounds"
            for (server, c), v in ratios.items() if len(v) > 1]


def fail(message: str):
    raise SystemExit(f"bench_serve_load: error: {message}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="HF checkpoint directory or 'demo' (default)")
    p.add_argument("--draft", type=Path, default=DEFAULT_DRAFT, help=f"EAGLE-3 draft (default {DEFAULT_DRAFT})")
    p.add_argument("--configs", default="plain,spec,adaptive", help="comma list of " + ", ".join(CONFIGS))
    p.add_argument("--concurrency", default="1,4,16,64", help="comma list of closed-loop concurrencies")
    p.add_argument("--num-prompts", type=int, help="per concurrency (default max(16, 4 * concurrency))")
    p.add_argument("--warmup", type=int, help="requests left out of each run (default: the concurrency)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: the server's (bf16 on CUDA)")
    p.add_argument("--max-running", type=int, default=64, help="server KV slots (at least the largest concurrency)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--rounds", type=int, default=1, help="run the whole sequence of servers this many times")
    p.add_argument("--out", type=Path, default=REPO / "out" / "serve_load.json", help="JSON results (and server logs)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or any(c not in CONFIGS for c in args.configs):
        fail(f"--configs takes a comma list of {', '.join(CONFIGS)}, got {','.join(args.configs)!r}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        fail(f"--concurrency takes a comma list of integers, got {args.concurrency!r}")
    if min(args.concurrency) < 1:
        fail("every --concurrency must be at least 1")
    if args.rounds < 1:
        fail(f"--rounds must be at least 1, got {args.rounds}")
    if any(c != "plain" for c in args.configs) and not (args.draft / "config.json").is_file():
        fail(f"--draft {args.draft}: no config.json there (not an EAGLE-3 draft directory)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"argv": sys.argv, "hardware": hardware(args.device), "servers": {}, "results": []}
    try:
        for rnd, name in ((rnd, name) for rnd in range(1, args.rounds + 1) for name in args.configs):
            port = free_port()
            log = args.out.with_suffix(f".{name}.log" if args.rounds == 1 else f".{name}.round{rnd}.log")
            server = Server(name, serve_argv(args, name, port), port, log)
            try:
                info = server.wait_healthy(args.start_timeout)
                report["servers"][name] = {"argv": server.proc.args, "config": info.get("config"),
                                           "model": info.get("model"), "versions": info.get("versions")}
                for c in args.concurrency:
                    row = {"round": rnd, **measure(args, server, c)}
                    report["results"].append(row)
                    print(f"round {rnd}, {name} c={c}: {row['output_tok_s']:.1f} tok/s, accept {row['accept_length']}",
                          file=sys.stderr, flush=True)
                    print("  " + engine_line(row["engine"], row["level_s"], row["front_end_cpu_s"]), file=sys.stderr,
                          flush=True)
                    if row["policy"]:
                        rates = {b: {k: round(v, 2 if k == "gain" else 1) for k, v in r.items()} for b, r in row["policy"].items()}
                        books = row["policy_books"]
                        delivered = {m: round(books["tokens"][m] / books["seconds"][m]) for m in ("speculative", "plain")
                                     if books["seconds"].get(m, 0) > 0 and m in books["tokens"]}
                        print(f"  policy after c={c}: {json.dumps(rates)}; during the level ({row['level_s']:.2f} s "
                              f"with its warm-up) it charged seconds {json.dumps({m: round(s, 2) for m, s in books['seconds'].items()})}"
                              f" in which each mode produced tokens/s {json.dumps(delivered)}", file=sys.stderr, flush=True)
            finally:
                server.stop()
    except EyasError as e:
        print(f"bench_serve_load: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_serve_load: interrupted", file=sys.stderr)
        return 130
    finally:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{report['hardware']}, model {args.model}, MT-bench, max_tokens {args.max_tokens}, greedy; "
          f"spec/plain = output tok/s over the plain server's at the same concurrency\n")
    print(table(report["results"]))
    slower = slower_than_plain(report["results"])
    print("\nslower than plain: " + ", ".join(slower) if slower else "\nnever slower than plain")
    if args.rounds > 1:
        print("spread over rounds: " + "; ".join(spread(report["results"])))
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
