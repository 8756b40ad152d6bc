"""`eyas serve` at TP=1 driven by the official openai client: the OpenAI surface, batching, errors, metrics."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from eyas import execution_plan
from tests.server.tiny import Server

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model):
    # Two steps in flight (the default, pinned): test_steps_in_flight.py checks one, these tests two.
    with Server(tiny_model, "--api-key", KEY, "--max-running", "4", "--max-queue", "40",
                "--steps-in-flight", "2") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=180)


def chat(client, server, text, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": text}], **kw)


def test_chat_greedy_equals_the_engine_alone(client, server, tokenizer, reference):
    r = chat(client, server, "Describe the parser.", max_tokens=24)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the parser."}],
                                        add_generation_prompt=True, tokenize=True)
    want, seq = reference(list(ids["input_ids"] if hasattr(ids, "keys") else ids), 24)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ("stop" if seq.finish_reason == "stop" else "length")
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(seq.prompt_ids), len(seq.output_ids))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # Plain decoding: one verify pass per token after the prefill's, so the acceptance length is exactly 1.
    assert u.model_extra["verify_passes"] == len(seq.output_ids) - 1
    assert u.model_extra["accept_length"] == 1.0


def test_completion_text_and_token_prompt_agree(client, server, tokenizer, reference):
    text = client.completions.create(model=server.model, prompt="The module", max_tokens=16, temperature=0)
    ids = tokenizer.encode("The module", add_special_tokens=True)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=16, temperature=0)
    assert text.choices[0].text == by_ids.choices[0].text == reference(ids, 16)[0]
    assert text.object == "text_completion" and text.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_equals_non_stream_and_ends_with_usage(client, server, kind):
    args = dict(model=server.model, max_tokens=20, temperature=0)
    if kind == "chat":
        args["messages"] = [{"role": "user", "content": "Stream this."}]
        create, piece = client.chat.completions.create, lambda c: c.choices[0].delta.content or ""
        full = lambda r: r.choices[0].message.content
    else:
        args["prompt"] = "Stream this."
        create, piece = client.completions.create, lambda c: c.choices[0].text
        full = lambda r: r.choices[0].text
    whole = create(**args)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **args))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(piece(c) for c in text_chunks) == full(whole)
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.model_extra["verify_passes"] == whole.usage.model_extra["verify_passes"]


def test_stream_wire_format_is_sse_ending_in_done(server):
    body = {"model": server.model, "prompt": "x", "max_tokens": 4, "temperature": 0, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    events = r.text.split("\n\n")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert all(e.startswith("data: {") for e in events[:-2])
    assert all("usage" not in json.loads(e[6:]) for e in events[:-2])  # usage only when asked for


def test_stop_string_cuts_the_text_and_says_stop(client, server):
    free = chat(client, server, "Go on.", max_tokens=40).choices[0].message.content
    stop = free[10:13]
    cut = chat(client, server, "Go on.", max_tokens=40, stop=[stop, "\x00never"])
    assert cut.choices[0].message.content == free[:free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = chat(client, server, "Go on.", max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == free[:free.index(stop)]


def test_32_concurrent_greedy_requests_match_each_alone(client, server):
    prompts = [(f"Request number {i}: tell me about {'abc'[i % 3]}.", 8 + i % 17) for i in range(32)]

    def one(p):
        r = chat(client, server, p[0], max_tokens=p[1])
        return r.choices[0].message.content, r.usage.completion_tokens

    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone
    info = httpx.get(server.url + "/metrics").text
    assert "eyas_queue_requests" in info and "eyas_kv_usage_ratio" in info


def test_seeded_sampling_is_reproducible(client, server):
    a = chat(client, server, "Pick.", max_tokens=16, temperature=1.0, seed=7).choices[0].message.content
    b = chat(client, server, "Pick.", max_tokens=16, temperature=1.0, seed=7, top_p=1.0).choices[0].message.content
    assert a == b


def post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**headers, "content-type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers)


@pytest.mark.parametrize("case, status, param", [
    ("malformed", 400, None), ("not-object", 400, None), ("unknown-model", 404, "model"),
    ("negative-max", 400, "max_tokens"), ("absurd-max", 400, "max_tokens"), ("too-long", 400, "messages"),
    ("wrong-key", 401, None), ("no-key", 401, None), ("n-2", 400, "n"), ("bad-temperature", 400, "temperature"),
    ("penalty", 400, "presence_penalty"), ("no-messages", 400, "messages"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case, status, param):
    good = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bodies = {
        "unknown-model": {**good, "model": "gpt-nope"},
        "negative-max": {**good, "max_tokens": -1},
        "absurd-max": {**good, "max_tokens": 10 ** 9},
        "too-long": {**good, "messages": [{"role": "user", "content": "parser " * 600}]},
        "n-2": {**good, "n": 2},
        "bad-temperature": {**good, "temperature": -1},
        "penalty": {**good, "presence_penalty": 0.5},
        "no-messages": {**good, "messages": []},
    }
    if case == "malformed":
        r = post(server, "/v1/chat/completions", None, raw=b'{"model": ')
    elif case == "not-object":
        r = post(server, "/v1/chat/completions", None, raw=b"[1, 2]")
    elif case in ("wrong-key", "no-key"):
        r = post(server, "/v1/chat/completions", good, key="nope" if case == "wrong-key" else None)
    else:
        r = post(server, "/v1/chat/completions", bodies[case])
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
    if param:
        assert err["param"] == param
    assert post(server, "/v1/chat/completions", good).status_code == 200


def test_api_key_guards_v1_but_not_health(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == server.model and models["data"][0]["max_model_len"] == 512


def test_client_disconnect_mid_stream_frees_the_slot(server):
    body = {"model": server.model, "prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # The request left long before its 400 tokens; the scheduler must have aborted it.
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and httpx.get(server.url + "/health").json()["requests"]:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["requests"] == 0
    assert 'eyas_requests_total{outcome="aborted"}' in httpx.get(server.url + "/metrics").text


def test_metrics_and_server_info(client, server):
    chat(client, server, "count me", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("eyas_requests_total", "eyas_prompt_tokens_total", "eyas_generation_tokens_total",
                 "eyas_time_to_first_token_seconds_bucket", "eyas_inter_token_latency_seconds_bucket",
                 "eyas_e2e_request_latency_seconds_bucket", "eyas_running_requests", "eyas_kv_usage_ratio",
                 "eyas_spec_accept_length_bucket", "eyas_spec_accepted_tokens_total",
                 'eyas_cycle_ms_bucket{le="0.5",phase="step"}'):
        assert name in text, name
    assert httpx.get(server.url + "/server_info").status_code == 401
    info = httpx.get(server.url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["config"]["api_key"] == "(set)" and KEY not in json.dumps(info)
    assert info["config"]["max_running"] == 4 and info["model"]["max_len"] == 512
    [worker] = info["workers"]
    assert worker["rank"] == 0 and worker["device"] == "cpu" and worker["pid"] > 0
    assert info["versions"]["torch"] == worker["torch"]
    # The engine's execution plan as it was decided at build: a CPU worker runs no kernels, graphs or run-ahead.
    plan = info["execution_plan"]
    assert plan["plan"] == execution_plan.DEFAULT.to_dict() and "execution_plan" not in info["model"]
    assert plan["device"] == "cpu" and not plan["kernels"] and not plan["pdl"] and not plan["cuda_graphs"]
    assert set(plan["projections"]["qkv"].values()) == {"torch"}
    assert "eyas: execution plan " + json.dumps(plan, separators=(",", ":")) in server.log()
