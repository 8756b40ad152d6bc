"""BenchResult: the numbers one run produced, as a dict for the ledger and as a fixed-width table for people."""

from collections import Counter
from dataclasses import asdict, dataclass

from eyas.bench.prometheus import Acceptance


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, the same rule as numpy's default."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> "LatencyStats | None":
        if not values:
            return None
        ms = [v * 1000.0 for v in values]
        return cls(sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass
class BenchResult:
    config: dict  # BenchConfig.to_dict() with the model actually used
    duration_s: float  # first request sent to last response ended; warm-up excluded
    completed: int
    errors: int
    error_messages: dict[str, int]  # message -> how many requests failed with it
    output_tok_s: float
    request_s: float
    total_output_tokens: int
    total_prompt_tokens: int
    ttft_ms: LatencyStats | None
    itl_ms: LatencyStats | None  # per streamed chunk; a chunk may hold several tokens
    tpot_ms: LatencyStats | None  # per token: (E2E - TTFT) / (output tokens - 1), per request
    e2e_ms: LatencyStats | None
    accept_length: float | None  # tokens per target verify pass, bonus token included
    accept_source: str | None  # "usage", "vllm-metrics", "sglang-metrics", "sglang-gauge"
    output_tokens_source: str  # "usage", or how many responses lacked usage and were counted by chunks

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        c = self.config
        accept = "n/a (server reports no acceptance)"
        if self.accept_length is not None:
            accept = f"{self.accept_length:.3f}  ({self.accept_source})"
        rows = [
            ("url", c.get("url")),
            ("model", c.get("model")),
            ("dataset", f"{c.get('dataset')}  ({self.completed + self.errors} requests, {c.get('endpoint')})"),
            ("load", _mode(c)),
            ("max tokens / temp", f"{c.get('max_tokens')} / {c.get('temperature')}"),
            None,
            ("completed / errors", f"{self.completed} / {self.errors}"),
            ("duration (s)", f"{self.duration_s:.2f}"),
            ("output tok/s", f"{self.output_tok_s:.1f}"),
            ("requests/s", f"{self.request_s:.3f}"),
            ("output tokens", f"{self.total_output_tokens}  (counted from {self.output_tokens_source})"),
            ("prompt tokens", str(self.total_prompt_tokens)),
            ("accept length", accept),
        ]
        width = 68
        lines = ["=" * width, "eyas bench".center(width), "=" * width]
        for row in rows:
            lines.append("-" * width if row is None else f"{row[0]:<20}{row[1]}")
        lines.append("-" * width)
        lines.append(f"{'latency (ms)':<20}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
        for name, s in (("TTFT", self.ttft_ms), ("ITL (per chunk)", self.itl_ms),
                        ("TPOT (per token)", self.tpot_ms), ("E2E", self.e2e_ms)):
            cells = [f"{v:>12.2f}" for v in (s.mean, s.p50, s.p90, s.p99)] if s else [f"{'-':>12}"] * 4
            lines.append(f"{name:<20}{''.join(cells)}")
        for msg, n in sorted(self.error_messages.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"error x{n}: {msg}")
        lines.append("=" * width)
        return "\n".join(lines)


def _mode(c: dict) -> str:
    if c.get("request_rate") is not None:
        return f"request rate {c['request_rate']:g}/s (Poisson, seed {c.get('seed')})"
    return f"concurrency {c.get('concurrency')} (closed loop)"


def summarize(config: dict, records: list, duration_s: float, from_metrics: Acceptance | None) -> BenchResult:
    """Fold per-request records (eyas.bench.client.RequestRecord) into one result."""
    ok = [r for r in records if r.error is None]
    errors = Counter(r.error for r in records if r.error is not None)
    no_usage = sum(1 for r in ok if r.output_tokens is None)
    tokens = [r.output_tokens if r.output_tokens is not None else r.content_chunks for r in ok]
    total_out = sum(tokens)

    tpot = [(r.e2e_s - r.ttft_s) / (n - 1) for r, n in zip(ok, tokens) if n > 1]
    gaps = [g for r in ok for g in r.chunk_gaps_s]

    accept = _acceptance_from_usage(ok, tokens) or from_metrics
    source = "usage" if no_usage == 0 else f"chunks for {no_usage} of {len(ok)} responses without usage"
    return BenchResult(
        config=config,
        duration_s=duration_s,
        completed=len(ok),
        errors=sum(errors.values()),
        error_messages=dict(errors),
        output_tok_s=total_out / duration_s if duration_s > 0 else 0.0,
        request_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        total_output_tokens=total_out,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        ttft_ms=LatencyStats.of_seconds([r.ttft_s for r in ok]),
        itl_ms=LatencyStats.of_seconds(gaps),
        tpot_ms=LatencyStats.of_seconds(tpot),
        e2e_ms=LatencyStats.of_seconds([r.e2e_s for r in ok]),
        accept_length=accept.length if accept else None,
        accept_source=accept.source if accept else None,
        output_tokens_source=source,
    )


def _acceptance_from_usage(ok: list, tokens: list[int]) -> Acceptance | None:
    # Weighted by verify passes, not a mean of per-request ratios: a 3-token reply must not count like a 300-token one.
    # eyas's definition, as in its usage field: tokens after the first (which prefill produces) per verify pass.
    total_tokens, total_passes = 0, 0.0
    for r, n in zip(ok, tokens):
        if r.verify_passes:
            passes = r.verify_passes
        elif r.accept_length:
            passes = max(n - 1, 0) / r.accept_length
        else:
            continue
        total_tokens += max(n - 1, 0)
        total_passes += passes
    return Acceptance(total_tokens / total_passes, "usage") if total_passes > 0 else None


def ledger_results(result) -> dict:
    """A BenchResult as flat, queryable ledger results: `eyas runs best --metric tpot_ms_p50` works."""
    d = result.to_dict()
    out = {k: d[k] for k in ("output_tok_s", "request_s", "completed", "errors", "duration_s", "total_output_tokens",
                             "total_prompt_tokens", "accept_length", "accept_source", "output_tokens_source")}
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for stat, value in (d[name] or {}).items():
            out[f"{name}_{stat}"] = value
    if result.error_messages:
        out["error_messages"] = result.error_messages
    return {k: v for k, v in out.items() if v is not None}
