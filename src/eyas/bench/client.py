"""Load generator for any OpenAI-compatible server (eyas, SGLang, vLLM): streams requests, times every chunk.

Usage: run_benchmark(BenchConfig(url="http://127.0.0.1:8000", dataset="mt-bench", concurrency=4))

Timing is taken where the client sees it: TTFT at the first chunk that carries text, ITL between such chunks,
E2E at the end of the stream. With speculative decoding one chunk can carry several tokens, so ITL is per chunk
and TPOT comes from the server's token count in `usage`, never from counting chunks (unless usage is missing,
which the result then says).
"""

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field, replace

import httpx
from tqdm import tqdm

from eyas.bench.config import BenchConfig
from eyas.bench.datasets import Prompt, load_prompts
from eyas.bench.prometheus import acceptance_from_metrics, parse_metrics
from eyas.bench.report import BenchResult, summarize
from eyas.errors import EyasError


@dataclass
class RequestRecord:
    prompt_id: str
    error: str | None = None  # "HTTP 500: message" etc.; None when the request succeeded
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    content_chunks: int = 0
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None
    accept_length: float | None = None  # eyas usage extension, per request
    verify_passes: int | None = None  # eyas usage extension: target forward passes that verified drafts


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps with mean 1/rate."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def request_body(config: BenchConfig, model: str, prompt: Prompt) -> dict:
    body = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "seed": config.seed,
        "stream": True,
        # Without this the stream carries no token counts and TPOT would have to guess from chunks.
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.text
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:  # /v1/completions
        return c.get("text") or ""
    delta = c.get("delta") or {}
    # Reasoning models stream their thinking in a separate field; it is generated tokens all the same.
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _error_message(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
        err = data.get("error", data.get("detail", data.get("message", text))) if isinstance(data, dict) else text
        if isinstance(err, dict):
            err = err.get("message", err)
        text = str(err)
    except json.JSONDecodeError:
        pass
    return f"HTTP {status}: {' '.join(text.split())[:200] or 'no message'}"


async def stream_one(http: httpx.AsyncClient, config: BenchConfig, model: str, prompt: Prompt) -> RequestRecord:
    rec = RequestRecord(prompt.id)
    start = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", config.path, json=request_body(config, model, prompt)) as resp:
            if resp.status_code != 200:
                rec.error = _error_message(resp.status_code, await resp.aread())
                return rec
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    # vLLM and SGLang report failures inside an already-started 200 stream.
                    rec.error = _error_message(resp.status_code, json.dumps(chunk).encode())
                    return rec
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage.get("completion_tokens")
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.accept_length = usage.get("accept_length")
                    rec.verify_passes = usage.get("verify_passes")
                if _chunk_text(chunk):
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.chunk_gaps_s.append(now - last)
                    last = now
                    rec.content_chunks += 1
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return rec
    except json.JSONDecodeError as e:
        rec.error = f"malformed stream chunk: {e.msg}"
        return rec
    rec.e2e_s = time.perf_counter() - start
    if rec.ttft_s is None:
        # Nothing to time: without a first token there is no TTFT, so the request cannot enter the statistics.
        rec.error = "stream ended without any generated text"
    return rec


async def run_requests(
    http: httpx.AsyncClient, config: BenchConfig, model: str, prompts: list[Prompt], progress: bool
) -> tuple[list[RequestRecord], float]:
    """Send every prompt once, closed-loop or open-loop; returns the records and the wall time of the run."""
    records: list[RequestRecord] = []
    bar = tqdm(total=len(prompts), file=sys.stderr, disable=not progress, unit="req", dynamic_ncols=True)

    async def one(p: Prompt):
        records.append(await stream_one(http, config, model, p))
        bar.update(1)

    start = time.perf_counter()
    if config.request_rate is None:
        queue = iter(prompts)

        async def worker():
            # Each worker sends its next request the moment its last one ends: at most C in flight.
            for p in queue:
                await one(p)

        await asyncio.gather(*(worker() for _ in range(min(config.concurrency, len(prompts)))))
    else:
        tasks = []
        for p, at in zip(prompts, poisson_arrivals(len(prompts), config.request_rate, config.seed)):
            # Open loop: arrivals follow the clock, however many requests are still in flight.
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(p)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return records, duration


async def _default_model(http: httpx.AsyncClient, config: BenchConfig) -> str:
    """Check that the server answers at all (one clear error if not) and return the model to ask for."""
    try:
        resp = await http.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise EyasError(f"cannot reach {config.url}: {type(e).__name__}: {e}") from None
    if resp.status_code == 401:
        raise EyasError(f"{config.url} refused the request (HTTP 401): pass --api-key")
    if config.model:
        return config.model
    if resp.status_code != 200:
        raise EyasError(f"{config.url}/v1/models answered {_error_message(resp.status_code, resp.content)}; pass --model")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise EyasError(f"{config.url}/v1/models lists no model; pass --model") from None


async def _scrape(http: httpx.AsyncClient) -> dict[str, list[float]]:
    try:
        resp = await http.get("/metrics", timeout=10.0)
    except httpx.HTTPError:
        return {}
    return parse_metrics(resp.text) if resp.status_code == 200 else {}


async def _run(config: BenchConfig) -> BenchResult:
    prompts = load_prompts(config.dataset, config.num_prompts, config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.timeout_s, connect=10.0, pool=None)
    # No connection cap: concurrency is the load generator's job, a pool limit would silently queue requests.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: an http_proxy in the environment would put a proxy's latency into every number.
    async with httpx.AsyncClient(
        base_url=config.url, headers=headers, timeout=timeout, limits=limits, trust_env=False
    ) as http:
        model = await _default_model(http, config)
        if config.warmup:
            warm = [prompts[i % len(prompts)] for i in range(config.warmup)]
            # Closed loop even for a rate run: warm-up exists to pay one-time costs, not to sample arrivals.
            warm_cfg = replace(config, request_rate=None, concurrency=config.concurrency or 1)
            records, _ = await run_requests(http, warm_cfg, model, warm, progress=False)
            if all(r.error for r in records):
                raise EyasError(f"every warm-up request failed, first with {records[0].error}")
        before = await _scrape(http)
        records, duration = await run_requests(http, config, model, prompts, config.progress)
        after = await _scrape(http)
    return summarize(config.to_dict() | {"model": model}, records, duration, acceptance_from_metrics(before, after))


def run_benchmark(config: BenchConfig) -> BenchResult:
    """One benchmark run against a live server; request errors are counted in the result, not raised."""
    return asyncio.run(_run(config))
