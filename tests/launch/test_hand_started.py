"""Servers started by hand leave a trace: `eyas serve` records its run, `eyas bench URL` records what the server is
(what it says about itself, the process tree behind its port, each process's environment), and `runs diff` of two
benches against hand-started servers names the variable the semicolon kept from the workers."""

import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import httpx

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.ledger.ledger import Ledger
from eyas.launch.server_identity import ask_server, info_gauges, sglang_facts
from tests.helpers import stop_process_group

DATA = Path(__file__).with_name("data")


def _serve_by_hand(line: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", line], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited: {line}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"no /health: {line}")


def _bench(capsys, port: int, prompts) -> str:
    code = main(["bench", "--url", f"http://127.0.0.1:{port}", "--dataset", str(prompts), "--num-prompts", "2",
                 "--max-tokens", "4", "--json"])
    _, err = capsys.readouterr()
    assert code == 0, err
    return err.split("recorded as run ", 1)[1].split()[0]


def test_serve_and_bench_of_hand_started_servers_and_their_diff(capsys, tiny, prompts, home):
    runs = {}
    for name, sep in (("good", " "), ("trap", "; ")):
        port = free_port()
        line = (f"NCCL_ALGO=Ring{sep}NCCL_PROTO=LL {sys.executable} -m eyas.cli serve --model {tiny} --tp 2 "
                f"--port {port} --device cpu")
        proc = _serve_by_hand(line, port)
        try:
            runs[name] = _bench(capsys, port, prompts)
        finally:
            stop_process_group(proc)
    with Ledger() as ledger:
        good, trap = ledger.get(runs["good"]), ledger.get(runs["trap"])
        serves = ledger.list(where={"kind": "serve"})
    server = good.config["server"]
    assert server["backend"] == "eyas" and server["config"]["tp"] == 2 and good.model == str(tiny)
    assert server["execution_plan"]["device"] == "cpu" and not server["execution_plan"]["kernels"]
    assert server["listener"]["cmdline"].split()[1:4] == ["-m", "eyas.cli", "serve"]
    assert len(good.workers) == server["listener"]["processes"] >= 3  # front end and two ranks
    assert all(w.env["NCCL_ALGO"] == "Ring" and w.env["NCCL_PROTO"] == "LL" for w in good.workers)
    assert all("NCCL_ALGO" not in w.env and w.env["NCCL_PROTO"] == "LL" for w in trap.workers)

    # each hand-started `eyas serve` recorded itself: configuration, each worker's report, a summary at SIGTERM
    assert len(serves) == 2 and all(s.status == "ok" for s in serves)
    assert sorted(w.worker for w in serves[0].workers) == ["rank0", "rank1"]
    assert serves[1].env["NCCL_ALGO"] == "Ring" and serves[1].workers[0].env["NCCL_ALGO"] == "Ring"
    assert "NCCL_ALGO" not in serves[0].env
    assert serves[1].results["requests_finished"] == 3 and serves[1].results["generation_tokens"] > 0  # warm-up + 2
    assert serves[1].results["execution_plan"] == server["execution_plan"]  # what the workers' engines decided

    capsys.readouterr()
    assert main(["runs", "diff", runs["good"], runs["trap"]]) == 0
    out, _ = capsys.readouterr()
    first = next(ln for ln in out.splitlines() if ln.startswith("1. "))
    assert "NCCL_ALGO" in first and "[workers]" in first, out


class _Recorded(BaseHTTPRequestHandler):
    bodies: dict = {}

    def do_GET(self):
        body = self.bodies.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def _serve_bodies(bodies: dict) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Handler", (_Recorded,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_sglang_server_info_keeps_its_server_arguments():
    """A /server_info body in SGLang's layout (every resolved server argument at the top level, version,
    launch_command, per-rank internal_states), with the values of the user's launch line."""
    info = json.loads((DATA / "sglang_server_info.json").read_text())
    kept = sglang_facts(info)
    assert kept["speculative_algorithm"] == "EAGLE3" and kept["speculative_num_steps"] == info["speculative_num_steps"]
    assert kept["tp_size"] == info["tp_size"] and kept["mem_fraction_static"] == info["mem_fraction_static"]
    assert "internal_states" not in kept and kept["version"] == info["version"]
    server, url = _serve_bodies({"/server_info": json.dumps(info).encode()})
    try:
        said, model = ask_server(url)
    finally:
        server.shutdown()
    assert said["backend"] == "sglang" and model == info["model_path"]
    assert said["server_args"]["speculative_eagle_topk"] == info["speculative_eagle_topk"]


def test_vllm_version_and_info_metrics():
    """Against /version and /metrics as a vLLM 0.32 CPU build (TP 3) served them."""
    metrics = (DATA / "vllm_metrics.txt").read_text()
    gauges = info_gauges(metrics)
    assert gauges["vllm:cache_config_info"]["block_size"].isdigit()
    version = (DATA / "vllm_version.json").read_bytes()
    server, url = _serve_bodies({"/version": version, "/metrics": metrics.encode()})
    try:
        said, _ = ask_server(url)
    finally:
        server.shutdown()
    assert said["backend"] == "vllm" and said["version"] == json.loads(version)["version"]
    assert said["metrics_info"] == gauges and gauges["vllm:cache_config_info"]["cache_dtype"] == "auto"
