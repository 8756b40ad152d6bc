"""A tiny real OpenAI-compatible server for the bench tests: FastAPI + uvicorn on 127.0.0.1 in a thread.

It streams a known number of tokens in chunks of a known size with known sleeps, so the client's measurements
can be checked against what the server did. It counts requests and the most it ever had in flight.
"""

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from eyas.dist.launch import free_port

MODEL = "stub-model"


@dataclass
class StubConfig:
    tokens: int = 8  # completion tokens per request
    tokens_per_chunk: int = 2  # as if every verify pass accepted one draft token plus the bonus
    ttft_s: float = 0.05
    chunk_gap_s: float = 0.01
    fail_every: int = 0  # every k-th request (1-based) answers HTTP 500
    usage: bool = True  # honour stream_options.include_usage
    spec_usage: bool = True  # eyas extension: usage.accept_length / usage.verify_passes
    metrics: str = "none"  # "vllm", "sglang", "sglang-gauge" or "none" (404)


@dataclass
class StubState:
    config: StubConfig = field(default_factory=StubConfig)
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list = field(default_factory=list)  # perf_counter at each request's arrival
    bodies: list = field(default_factory=list)
    paths: list = field(default_factory=list)
    auth: list = field(default_factory=list)
    # Counters start far from zero so a client that forgets to difference them gets a wrong answer.
    drafts: int = 1000
    accepted: int = 7000
    generated: int = 50000
    verifies: int = 1000


def build_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        s, style = state, state.config.metrics
        if style == "none":
            return PlainTextResponse("not found", status_code=404)
        lines = ["# HELP stub metrics", "# TYPE stub counter"]
        if style == "vllm":
            # Two engines (data parallel): the client must sum label sets.
            for eng, share in (("0", 0.25), ("1", 0.75)):
                lbl = f'{{model_name="{MODEL}",engine="{eng}"}}'
                lines += [f"vllm:spec_decode_num_drafts_total{lbl} {s.drafts * share}",
                          f"vllm:spec_decode_num_accepted_tokens_total{lbl} {s.accepted * share}",
                          f"vllm:spec_decode_num_drafts_created{lbl} 1.7e9"]
        elif style == "sglang":
            lbl = f'{{model_name="{MODEL}",label with="a space"}}'
            lines += [f"sglang:generation_tokens_total{lbl} {s.generated}",
                      f"sglang:spec_verify_calls_total{lbl} {s.verifies}",
                      f"sglang:spec_accept_length{lbl} 9.5"]
        else:
            lines += [f'sglang:spec_accept_length{{model_name="{MODEL}"}} 3.25']
        return PlainTextResponse("\n".join(lines) + "\n")

    async def complete(request: Request, chat: bool):
        cfg = state.config
        body = await request.json()
        state.requests += 1
        n = state.requests
        state.arrivals.append(time.perf_counter())
        state.bodies.append(body)
        state.paths.append(request.url.path)
        state.auth.append(request.headers.get("authorization"))
        if cfg.fail_every and n % cfg.fail_every == 0:
            return JSONResponse({"error": {"message": f"stub failure on request {n}", "code": 500}}, status_code=500)

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(cfg.ttft_s)
                chunks = math.ceil(cfg.tokens / cfg.tokens_per_chunk)
                left = cfg.tokens
                for i in range(chunks):
                    if i:
                        await asyncio.sleep(cfg.chunk_gap_s)
                    k = min(cfg.tokens_per_chunk, left)
                    left -= k
                    text = "tok " * k
                    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                    yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
                state.drafts += chunks
                state.accepted += cfg.tokens - chunks
                state.generated += cfg.tokens
                state.verifies += chunks
                if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 5, "completion_tokens": cfg.tokens, "total_tokens": 5 + cfg.tokens}
                    if cfg.spec_usage:
                        # eyas's definition: tokens after the prefill token, per verify pass
                        usage |= {"accept_length": (cfg.tokens - 1) / chunks, "verify_passes": chunks}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


@pytest.fixture
def unused_port() -> int:
    """A port that was free a moment ago: bound, then released, so nothing listens there."""
    return free_port()


@contextlib.contextmanager
def serving(app):
    """`app` served by uvicorn in a thread; yields its URL. The socket is bound here (port 0) and handed to uvicorn,
    so no other process can take the port between its choice and uvicorn listening on it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "stub server did not start within 10 s"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


@pytest.fixture(scope="session")
def _server():
    state = StubState()
    with serving(build_app(state)) as url:
        yield state, url


@pytest.fixture
def stub(_server):
    """(state, url) with fresh counters; set state.config before the run."""
    state, url = _server
    fresh = StubState()
    for name in vars(fresh):
        setattr(state, name, getattr(fresh, name))
    return state, url
