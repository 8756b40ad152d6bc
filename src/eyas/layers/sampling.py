"""The one sampler: greedy, temperature, top-k and top-p, batched, on the device of the logits.

`adjusted_probs` is also what speculative rejection sampling compares against, so the distribution
the engine samples from plainly and the one it verifies against are the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.errors import EyasError

MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0          # 0 = no limit
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # return each token's log-probability and this many top alternatives; None: off

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN and inf fail too: they would sample garbage
            raise EyasError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EyasError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EyasError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise EyasError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise EyasError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def adjusted_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p; logits [..., V] fp32."""
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and the most likely tokens of the same row."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The target's log-probabilities of `tokens` [n], token i under row i of logits [n, V], with each row's
    `top` most likely tokens. Raw log-softmax of the logits, before temperature, top-p and top-k (what
    OpenAI's API and vLLM report), so a token's figure does not depend on how it was chosen: sampled plainly,
    or accepted from a draft against the verify pass's row at its position. One device-to-host copy."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    values, best = lp.topk(top, dim=-1)
    values, best = values.tolist(), best.tolist()
    return [TokenLogprob(t, c, tuple(zip(b, v))) for t, c, b, v in zip(tokens, chosen, best, values)]


def uniform(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One uniform draw [1] on the device of `probs`, from `generator` (or the global one)."""
    return torch.rand((1,), device=probs.device, generator=generator, dtype=probs.dtype)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of `probs` [..., V] by inverse CDF, so one uniform per row suffices
    (`u` [...] supplies them; otherwise they come from `generator`)."""
    if u is None:
        u = torch.rand(probs.shape[:-1] + (1,), device=probs.device, generator=generator, dtype=probs.dtype)
    else:
        u = u.reshape(probs.shape[:-1] + (1,)).to(probs.dtype)
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:]).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> tokens [B] for requests sharing one SamplingParams."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_from(adjusted_probs(logits, params.temperature, params.top_p, params.top_k), generator)
