"""A request's state as it moves through the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.layers.sampling import SamplingParams, TokenLogprob


@dataclass
class Sequence:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0                 # target tokens whose KV is in the cache
    finish_reason: str | None = None
    verify_passes: int = 0          # target forwards after prefill (decode steps or verify passes)
    generator: torch.Generator | None = None
    draft_state: object = None      # owned by the speculative decoder
    logprobs: list[TokenLogprob] | None = None  # one per output token, when params.logprobs asks for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def accept_length(self) -> float:
        """Generated tokens per target verify pass (SGLang's definition); the prefill token is not counted."""
        return (len(self.output_ids) - 1) / self.verify_passes if self.verify_passes else 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def append(self, tokens: list[int], eos_ids: set[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append accepted tokens up to a stop; returns those actually kept. `logprobs` (one per token, when
        the request asked for them) are kept with their tokens."""
        kept = []
        for t in tokens:
            kept.append(t)
            self.output_ids.append(t)
            if (t in eos_ids and not self.params.ignore_eos) or t in self.params.stop_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs[:len(kept)])
        return kept

