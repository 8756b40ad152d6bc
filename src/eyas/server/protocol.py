"""The OpenAI request bodies we accept (pydantic) and the response bodies we send (plain dicts).

Defaults follow OpenAI: temperature 1, top_p 1, /v1/completions max_tokens 16, chat max_tokens "the rest of the
context". Extensions, as in vLLM: `top_k`, `ignore_eos`. Log-probabilities (chat `logprobs` + `top_logprobs`,
completions `logprobs` = the number of alternatives) are the target's raw ones, before temperature and top-p/k. Parameters we do not implement are refused with a 400
naming them rather than silently ignored, because a benchmark that asked for a penalty would otherwise measure
something it did not ask for. `usage` carries two eyas extensions the bench client reads: `verify_passes` (target
forwards after prefill) and `accept_length` ((completion_tokens - 1) / verify_passes, SGLang's definition).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from eyas.layers.sampling import MAX_LOGPROBS

# Fields refused when set to anything but their neutral value.
UNSUPPORTED = ("logit_bias", "presence_penalty", "frequency_penalty", "echo", "suffix",
               "tools", "tool_choice", "functions", "response_format", "repetition_penalty")


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                 # -1 or 0: no limit
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    def unsupported(self) -> str | None:
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) not in (None, False, 0, [], {}):
                return name
        return None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token; None: no log-probs

    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """String content, or the text parts of a multi-part content joined; other parts are refused upstream."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content)

    def has_non_text(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") != "text" for p in self.content)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ----------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, verify_passes: int) -> dict:
    accept = (completion_tokens - 1) / verify_passes if verify_passes else 0.0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "accept_length": round(accept, 4),
            "verify_passes": verify_passes}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, created: int,
                    logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None, created: int,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, created: int,
              logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, created: int,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict, created: int) -> dict:
    """The extra last chunk `stream_options.include_usage` asks for: no choices, only usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def model_list(name: str, max_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "eyas",
                                        "max_model_len": max_len}]}


def now() -> int:
    return int(time.time())
