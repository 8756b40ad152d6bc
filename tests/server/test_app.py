"""The HTTP layer alone, over a stub scheduler: health states, token delivery, refusals. No processes."""

import pytest
from fastapi.testclient import TestClient

from eyas.dist.messages import ModelInfo, RequestUpdate
from eyas.server.app import ServerState, build_app
from eyas.server.config import ServeConfig
from eyas.server.metrics import Metrics
from eyas.server.scheduler import Failure, QueueFull


class StubScheduler:
    """Answers every request at once with fixed tokens in two steps, as a speculative engine would."""

    def __init__(self, tokens):
        self.tokens, self.healthy, self.error, self.in_system = tokens, True, None, 0
        self.full, self.fail, self.aborted = False, False, []

    def submit(self, sub):
        if self.full:
            raise QueueFull("at capacity")
        if self.fail:
            sub.deliver(Failure("worker 0 exited with code -9"))
            return
        half = len(self.tokens) // 2
        sub.deliver(RequestUpdate(sub.id, self.tokens[:half], None, 1))
        sub.deliver(RequestUpdate(sub.id, self.tokens[half:], "length", 2))

    def abort(self, rid):
        self.aborted.append(rid)


@pytest.fixture
def app(tokenizer):
    tokens = tokenizer.encode(" the parser reads the file", add_special_tokens=False)
    sched = StubScheduler(tokens)
    info = ModelInfo(max_len=64, margin=1, vocab_size=512, eos_token_ids=[2], device="cpu", dtype="fp32",
                     speculative=False)
    draining = {"on": False}
    state = ServerState(config=ServeConfig(model="m"), info=info, tokenizer=tokenizer, scheduler=sched,
                        metrics=Metrics(), reports=[], env_problems=[], versions={},
                        draining=lambda: draining["on"])
    return TestClient(build_app(state)), sched, draining, tokens


def test_health_reports_ok_unhealthy_and_draining(app):
    client, sched, draining, _ = app
    assert client.get("/health").status_code == 200
    draining["on"] = True
    assert client.get("/health").json() == {"status": "draining"}
    sched.healthy, sched.error = False, "worker 1 exited with code -9"
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"] == "worker 1 exited with code -9"


def test_tokens_become_text_and_usage(app):
    client, _, _, tokens = app
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10}).json()
    assert r["choices"][0]["text"] == " the parser reads the file"
    assert r["usage"]["completion_tokens"] == len(tokens) and r["usage"]["verify_passes"] == 2
    assert r["usage"]["accept_length"] == round((len(tokens) - 1) / 2, 4)


def test_queue_full_is_503_and_worker_failure_is_500(app):
    client, sched, _, _ = app
    sched.full = True
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
    sched.full, sched.fail = False, True
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10})
    assert r.status_code == 500 and "worker 0 exited" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10, "stream": True})
    assert r.status_code == 200 and '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")


def test_prompt_ids_outside_the_vocabulary_are_refused(app):
    client, _, _, _ = app
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 512], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
