"""The HTTP front end: OpenAI routes over the scheduler, plus health, metrics and server info.

It never touches a model: it tokenizes, validates each request against the context the workers reported,
submits it, and formats what comes back, as one JSON body or as server-sent events.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from eyas.errors import EyasError
from eyas.layers.sampling import SamplingParams
from eyas.models.tokenizer import encode_messages
from eyas.server import protocol as P
from eyas.server.errors import APIError, bad_request
from eyas.server.generation import Generation
from eyas.server.logprobs import LogprobFormatter


@dataclass
class ServerState:
    config: object            # ServeConfig
    info: object              # eyas.dist.messages.ModelInfo from the workers
    tokenizer: object
    scheduler: object
    metrics: object
    reports: list             # EnvReport per worker
    env_problems: list[str]
    versions: dict
    started: int = field(default_factory=P.now)
    draining: object = lambda: False  # set by the CLI: is the HTTP server shutting down?


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="eyas", docs_url=None, redoc_url=None, openapi_url=None)
    cfg, info = state.config, state.info

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def parse(request: Request, model: type[BaseModel]):
        authorize(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise bad_request(f"{where}: {err['msg']}", param=where) from None
        if req.model != cfg.model:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{cfg.model}'",
                           param="model", code="model_not_found")
        if req.n != 1 or (req.best_of or 1) != 1:
            raise bad_request("only n=1 (and best_of=1) is supported", param="n")
        name = req.unsupported()
        if name:
            raise bad_request(f"'{name}' is not supported by this server", param=name)
        if any(not s for s in req.stop_strings()):
            raise bad_request("stop strings must not be empty", param="stop")
        if getattr(req, "top_logprobs", None) is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return req

    def sampling(req, max_tokens: int | None, prompt_len: int, prompt_param: str) -> SamplingParams:
        room = info.max_len - info.margin - prompt_len
        if room < 1:
            raise bad_request(f"the prompt is {prompt_len} tokens; this server's context holds at most "
                              f"{info.max_len - info.margin - 1} prompt tokens", param=prompt_param)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        elif max_tokens > room:
            raise bad_request(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                              f"{info.max_len - info.margin} tokens", param="max_tokens")
        # Every rank samples with its own generator: an explicit seed is what keeps the ranks in agreement.
        seed = req.seed if req.seed is not None or req.temperature == 0 else secrets.randbits(63)
        try:
            return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                                  max_tokens=max_tokens, seed=seed, ignore_eos=req.ignore_eos,
                                  logprobs=req.logprob_count())
        except EyasError as e:
            raise bad_request(str(e)) from None

    def completion_prompt(req: P.CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("send one prompt per request (a list of prompts is not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = state.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            if any(not 0 <= t < info.vocab_size for t in ids):
                raise bad_request(f"prompt token ids must be in 0..{info.vocab_size - 1}", param="prompt")
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        return ids

    def chat_prompt(req: P.ChatRequest) -> list[int]:
        if not getattr(state.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions")
        if any(m.has_non_text() for m in req.messages):
            raise bad_request("only text message content is supported", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            return encode_messages(state.tokenizer, messages)
        except Exception as e:  # the template itself may refuse (e.g. roles out of order)
            raise bad_request(f"the chat template refused these messages: {e}", param="messages") from None

    async def run(gen: Generation, req, chat: bool):
        created = P.now()
        if req.stream:
            return StreamingResponse(stream(gen, req, chat, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        parts, finish, entries = [], None, []
        async with aclosing(gen.text()) as pieces:
            async for text, finish, logprobs in pieces:
                parts.append(text)
                entries.extend(logprobs)
        body = (P.chat_body if chat else P.completion_body)(gen.id, cfg.model, "".join(parts), finish, gen.usage(),
                                                            created, logprobs_body(req, chat, entries))
        return JSONResponse(body)

    def logprobs_body(req, chat: bool, entries, formatter: LogprobFormatter | None = None) -> dict | None:
        """The choice's `logprobs` for these tokens, in the endpoint's shape; None when not asked for."""
        if req.logprob_count() is None:
            return None
        formatter = formatter or LogprobFormatter(state.tokenizer)
        return formatter.chat(entries) if chat else formatter.completion(entries)

    async def stream(gen: Generation, req, chat: bool, created: int):
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                yield sse(P.chat_chunk(gen.id, cfg.model, {"role": "assistant", "content": ""}, None, created))
            # aclosing: when the client leaves, the generation's cleanup (abort, free the slot) runs now, not at GC.
            formatter = LogprobFormatter(state.tokenizer)  # one per stream: completions' text_offset runs on
            async with aclosing(gen.text()) as pieces:
                async for text, finish, logprobs in pieces:
                    lp = logprobs_body(req, chat, logprobs, formatter)
                    if chat:
                        if text or logprobs:
                            yield sse(P.chat_chunk(gen.id, cfg.model, {"content": text}, None, created, lp))
                        if finish:
                            yield sse(P.chat_chunk(gen.id, cfg.model, {}, finish, created))
                    elif text or finish:
                        yield sse(P.completion_chunk(gen.id, cfg.model, text, finish, created, lp))
            if req.include_usage:
                yield sse(P.usage_chunk(gen.id, cfg.model, obj, gen.usage(), created))
        except APIError as e:  # the 200 has been sent; say it inside the stream, as vLLM and SGLang do
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    def generation(prompt_ids, params, req, arrival, prefix) -> Generation:
        gen = Generation(state.scheduler, state.tokenizer, state.metrics, prompt_ids, params, req.stop_strings(),
                         arrival, prefix)
        gen.start()
        return gen

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        req = await parse(request, P.CompletionRequest)
        ids = completion_prompt(req)
        gen = generation(ids, sampling(req, req.max_tokens, len(ids), "prompt"), req, arrival, "cmpl")
        return await run(gen, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        req = await parse(request, P.ChatRequest)
        ids = chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        gen = generation(ids, sampling(req, max_tokens, len(ids), "messages"), req, arrival, "chatcmpl")
        return await run(gen, req, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return P.model_list(cfg.model, info.max_len, state.started)

    @app.get("/health")
    async def health():
        sched = state.scheduler
        if not sched.healthy:
            return JSONResponse({"status": "unhealthy", "error": sched.error}, status_code=503)
        if state.draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "requests": sched.in_system}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/server_info")
    async def server_info(request: Request):
        authorize(request)
        model = asdict(info)
        plan = model.pop("execution_plan")
        return {"config": cfg.public(), "model": model, "execution_plan": plan, "versions": state.versions,
                "started": state.started, "healthy": state.scheduler.healthy,
                "env_check": {"mode": cfg.env_check, "problems": state.env_problems},
                "workers": [r.to_dict() for r in state.reports]}

    return app
