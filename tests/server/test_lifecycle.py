"""Start-up and shutdown: a full queue answers 503, SIGTERM drains and exits 0, a dead worker ends the server."""

import json
import os
import signal
import threading
import time

import httpx

from tests.server.tiny import Server


def open_stream(server, max_tokens: int):
    """Start a streaming completion in a thread; returns (first chunk seen event, result dict)."""
    started, result = threading.Event(), {"chunks": [], "error": None}

    def run():
        body = {"model": server.model, "prompt": "drain me", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["chunks"].append(line[6:])
                        started.set()
        except httpx.HTTPError as e:
            result["error"] = repr(e)
        started.set()

    t = threading.Thread(target=run)
    t.start()
    return started, result, t


def test_full_queue_is_503_and_sigterm_to_the_group_drains_running_requests(tiny_model):
    with Server(tiny_model, "--max-running", "1", "--max-queue", "0") as server:
        started, result, t = open_stream(server, max_tokens=480)
        assert started.wait(30)
        body = {"model": server.model, "prompt": "one too many", "max_tokens": 4}
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"

        # To the whole process group, as systemd and `timeout` do: the workers must outlive it to finish the drain.
        os.killpg(server.proc.pid, signal.SIGTERM)
        refused_while_streaming = False
        while t.is_alive() and not refused_while_streaming:
            try:
                httpx.get(server.url + "/health", timeout=1)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # the listening socket is closed (or closing under this very request): no new requests
                refused_while_streaming = t.is_alive()
            time.sleep(0.01)
        assert refused_while_streaming
        t.join(60)
        rc = server.wait_exit(30)
        assert rc == 0, server.log()
        # The running request was not cut: all 480 tokens arrived, then usage, then [DONE].
        assert result["error"] is None and result["chunks"][-1] == "[DONE]"
        usage = json.loads(result["chunks"][-2])["usage"]
        assert usage["completion_tokens"] == 480
        assert json.loads(result["chunks"][-3])["choices"][0]["finish_reason"] == "length"
        assert "eyas: stopped" in server.log()


def test_killed_worker_fails_health_and_exits_nonzero_within_10s(tiny_model):
    # TP=2 and rank 1 dies mid-stream: rank 0 is left inside a collective that will never complete.
    with Server(tiny_model, "--tp", "2") as server:
        worker = httpx.get(server.url + "/server_info").json()["workers"][1]
        started, result, t = open_stream(server, max_tokens=400)
        assert started.wait(30)
        os.kill(worker["pid"], signal.SIGKILL)
        killed = time.monotonic()
        unhealthy = None
        while time.monotonic() - killed < 10 and server.proc.poll() is None:
            try:
                if httpx.get(server.url + "/health", timeout=1).status_code == 503:
                    unhealthy = time.monotonic()
            except httpx.HTTPError:  # already gone: the listening socket closed
                break
            time.sleep(0.02)
        rc = server.wait_exit(max(0.1, 10 - (time.monotonic() - killed)))
        assert rc not in (0, None), server.log()
        assert time.monotonic() - killed < 10
        assert "worker 1 exited with code -9" in server.log()
        t.join(10)
        # The in-flight stream ended with an error (or a dropped connection), never a hang.
        assert not t.is_alive()
        assert result["error"] is not None or any('"error"' in c for c in result["chunks"])
        # Between the death and the exit /health says 503 (the window is short; test_app covers it directly).
        assert unhealthy is None or unhealthy - killed < 10
