"""Start-up and shutdown: a full queue answers 503, SIGTERM drains and exits 0. (A dead worker ending the server:
test_tp.py, on its TP=2 server.)"""

import json
import os
import signal
import time

import httpx

from tests.server.tiny import Server, open_stream


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
