"""Servers started by hand, as our user starts them, measured with `eyas bench`: `runs diff` names, on its first
cause line, the variable that `NCCL_ALGO=Ring; ...` (a shell variable, not exported) never handed the server."""

import json
import subprocess
import sys
import time

import httpx

from eyas.cli import main
from eyas.dist.launch import free_port
from tests.server.tiny import tiny_chat_model

PROGRAM = "import sys; from eyas.cli import main; sys.exit(main(sys.argv[1:]))"


def _wait(url, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the hand-started server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the hand-started server never answered /health")


def _serve_by_hand_and_bench(prefix, model, prompts, capsys):
    port = free_port()
    line = (f"{prefix} exec {sys.executable} -c '{PROGRAM}' serve --model {model} --device cpu --port {port} "
            f"--no-record")
    proc = subprocess.Popen(["bash", "-c", line], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url, proc)
        code = main(["bench", "--url", url, "--dataset", str(prompts), "--num-prompts", "2", "--max-tokens", "8"])
        err = capsys.readouterr().err
        assert code == 0, err
        return next(w for w in err.split() if w[:1].isdigit() and "-" in w)  # "eyas: recorded as run ID"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_variable_the_shell_never_exported_is_the_first_cause(tmp_path, capsys):
    model = tiny_chat_model(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello there", "The parser reads"]))
    good = _serve_by_hand_and_bench("NCCL_ALGO=Ring NCCL_PROTO=LL", model, prompts, capsys)
    lost = _serve_by_hand_and_bench("NCCL_ALGO=Ring; NCCL_PROTO=LL", model, prompts, capsys)
    assert main(["runs", "diff", good, lost]) == 0
    out = capsys.readouterr().out
    first = out.split("most plausible explanations, in order:\n")[1].splitlines()[0]
    assert first.startswith("1. [workers] NCCL_ALGO: Ring x") and "missing in every worker of B" in first
    assert "NCCL_PROTO" not in out.split("\nresults\n")[0]  # reached both servers: not a cause
