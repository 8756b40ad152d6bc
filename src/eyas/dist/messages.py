"""Typed messages between the server's front end and its engine workers.

Commands go to every worker, in the same order, over one queue per worker; that order is the whole
lockstep protocol: each rank applies the same adds, aborts and steps to the same Engine, so every rank
makes the same scheduling decisions and the collectives inside the model always pair up.

Results come back on one shared queue: every worker reports its environment and readiness at start-up;
after that only rank 0 reports (the ranks' tokens are identical, since logits are all-gathered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.layers.sampling import SamplingParams

# -- front end -> every worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Step:
    """Admit what fits, then run one decode step (or one speculative cycle) for every running request."""


@dataclass(frozen=True)
class Abort:
    id: str


@dataclass(frozen=True)
class Shutdown:
    pass


# -- workers -> front end -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvReported:
    rank: int
    report: dict  # eyas.dist.env_report.EnvReport.to_dict()


@dataclass(frozen=True)
class ModelInfo:
    """What the front end must know to validate requests exactly as the engine will."""

    max_len: int          # tokens per sequence (prompt + output + speculative lookahead)
    margin: int           # cache columns the engine keeps free past the last token (speculation looks ahead)
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    speculative: bool
    weight_bytes: int = 0    # this rank's target weights as loaded (packed, for a quantized checkpoint)
    kv_cache_bytes: int = 0  # this rank's target KV cache
    execution_plan: dict = field(default_factory=dict)  # Engine.execution_plan_summary


@dataclass(frozen=True)
class Ready:
    rank: int
    info: ModelInfo


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    message: str  # one line


@dataclass(frozen=True)
class RequestUpdate:
    id: str
    new_ids: list[int]             # tokens accepted this step: speculation can accept several at once
    finish_reason: str | None      # "stop" | "length" | None while running
    verify_passes: int             # target forwards after prefill so far
    error: str | None = None       # the engine refused the request (one line); no tokens follow
    logprobs: list | None = None   # TokenLogprob per new token, when the request asked for them


@dataclass(frozen=True)
class StepResult:
    updates: list[RequestUpdate]
    running: int                   # requests holding a cache slot after the step
    waiting: int                   # requests the engine accepted but has not admitted yet
    kv_usage: float                # fraction of cache slots in use
    step_ms: float                 # wall time of the whole step on rank 0
    joined: int = 0                # requests the step admitted and prefilled
    phase_ms: dict[str, list[float]] = field(default_factory=dict)  # --profile: per-phase times of this step
    spec_step: tuple[int, bool] | None = None  # with a draft: (batch size, speculated) of this step
    spec_policy: dict | None = None  # adaptive: SpecPolicy.snapshot(), every POLICY_EVERY steps and when idle
