"""Prometheus metrics, one registry per app (so two servers in one test process never share counters).

Names follow vLLM/SGLang practice with an `eyas_` prefix. Acceptance is exported both ways benchmarks
read it: counters of verify passes and accepted draft tokens (mean acceptance length over any window is
1 + delta(accepted) / delta(verify passes)), and a histogram of per-request acceptance length.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from eyas.spec_policy import bucket

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
           20.0, 40.0, 80.0)
CYCLE_MS = (0.5, 1, 2, 4, 6, 8, 10, 15, 20, 30, 40, 60, 80, 120, 200, 400, 1000)
ACCEPT = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eyas_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("eyas_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("eyas_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("eyas_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY,
                              registry=r)
        self.itl = Histogram("eyas_inter_token_latency_seconds", "Gap between tokens (a step's gap split over "
                             "the tokens it accepted)", buckets=LATENCY, registry=r)
        self.e2e = Histogram("eyas_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY,
                             registry=r)
        self.queue = Gauge("eyas_queue_requests", "Requests accepted but not yet holding a cache slot", registry=r)
        self.running = Gauge("eyas_running_requests", "Requests holding a cache slot", registry=r)
        self.kv_usage = Gauge("eyas_kv_usage_ratio", "Fraction of KV cache slots in use", registry=r)
        self.verify_passes = Counter("eyas_spec_verify_passes", "Target forwards after prefill", registry=r)
        self.accepted = Counter("eyas_spec_accepted_tokens", "Draft tokens accepted (generated - 1 - verify "
                                "passes, per request)", registry=r)
        self.accept_length = Histogram("eyas_spec_accept_length", "Per-request acceptance length",
                                       buckets=ACCEPT, registry=r)
        self.cycle = Histogram("eyas_cycle_ms", "Engine step time (phase step: every step; step_with_joins: the steps "
                               "that prefilled joining requests); per phase with --profile", ["phase"],
                               buckets=CYCLE_MS, registry=r)
        self.joined = Counter("eyas_joined_requests", "Requests admitted and prefilled (in the steps counted as "
                              "eyas_cycle_ms{phase=\"step_with_joins\"})", registry=r)
        self.spec_steps = Counter("eyas_spec_steps", "Steps under a draft by batch-size bucket and mode "
                                  "(speculative cycle or plain step: what the adaptive policy chose)",
                                  ["bucket", "mode"], registry=r)
        self.spec_rate = Gauge("eyas_spec_rate_tokens_per_second", "The adaptive policy's measured rate of each "
                               "mode, tokens/s per running sequence, by batch-size bucket", ["bucket", "mode"],
                               registry=r)
        self.spec_seconds = Gauge("eyas_spec_policy_seconds", "Engine seconds the adaptive policy charged to "
                                  "each mode's windows so far (void: windows with a CUDA-graph capture; prefill: joining "
                                  "requests' prefills, booked apart)", ["mode"],
                                  registry=r)
        self.spec_tokens = Gauge("eyas_spec_policy_tokens", "Tokens produced in those seconds, by mode", ["mode"],
                                 registry=r)

    def step(self, result) -> None:
        self.queue.set(result.waiting)
        self.running.set(result.running)
        self.kv_usage.set(result.kv_usage)
        self.cycle.labels("step").observe(result.step_ms)
        if result.joined:  # steps that prefilled joining requests, apart: a join costs far more than a step
            self.cycle.labels("step_with_joins").observe(result.step_ms)
            self.joined.inc(result.joined)
        for phase, times in result.phase_ms.items():
            for ms in times:
                self.cycle.labels(phase).observe(ms)
        if result.spec_step is not None:
            n, speculated = result.spec_step
            self.spec_steps.labels(str(bucket(n)), "speculative" if speculated else "plain").inc()
        policy = result.spec_policy or {}
        for (b, speculated), rate in policy.get("rates", {}).items():
            self.spec_rate.labels(str(b), "speculative" if speculated else "plain").set(rate)
        for mode, seconds in policy.get("seconds", {}).items():
            self.spec_seconds.labels(mode).set(seconds)
        for mode, tokens in policy.get("tokens", {}).items():
            self.spec_tokens.labels(mode).set(tokens)

    def finished(self, outcome: str, prompt_tokens: int, completion_tokens: int, verify_passes: int,
                 e2e_s: float | None) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if verify_passes:
            self.verify_passes.inc(verify_passes)
            self.accepted.inc(max(0, completion_tokens - 1 - verify_passes))
            self.accept_length.observe((completion_tokens - 1) / verify_passes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
