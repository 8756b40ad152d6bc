"""Acceptance length from a server's Prometheus /metrics, read before and after the measured run.

Used when the responses themselves do not carry acceptance (eyas puts it in `usage`; SGLang and vLLM do not on
their OpenAI routes). Counters are differenced across the run so earlier traffic does not leak in; traffic from
other clients during the run still does, which is why the result names its source.

Metric names, checked against the engines' sources:
- vLLM `vllm/v1/spec_decode/metrics.py` registers Counters `vllm:spec_decode_num_drafts` and
  `vllm:spec_decode_num_accepted_tokens`, exposed with the `_total` suffix; vLLM's own definition of mean
  acceptance length is 1 + accepted / drafts (the bonus token counts).
- SGLang `srt/metrics/collector.py` (newer: `srt/observability/...`) adds each finished request's
  `spec_verify_ct` to Counter `sglang:spec_verify_calls_total` next to `sglang:generation_tokens_total`; SGLang's
  per-request acceptance is completion_tokens / spec_verify_ct, so the run's value is the ratio of the deltas.
  Older SGLang has only the Gauge `sglang:spec_accept_length`, an average over its last logging window.
"""

import re
from dataclasses import dataclass

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SGLANG_GENERATED = "sglang:generation_tokens_total"
SGLANG_VERIFIES = "sglang:spec_verify_calls_total"
SGLANG_ACCEPT_GAUGE = "sglang:spec_accept_length"


@dataclass(frozen=True)
class Acceptance:
    length: float
    source: str  # "usage", "vllm-metrics", "sglang-metrics" or "sglang-gauge"


def parse_metrics(text: str) -> dict[str, list[float]]:
    """Prometheus text format -> {metric name: [value per label set]}."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # Label values may hold spaces, so split the name off at '{' and take the value after the last '}'.
        if "{" in line:
            name, rest = line.split("{", 1)
            rest = rest[rest.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out.setdefault(name.strip(), []).append(value)
    return out


LABEL = re.compile(r'(\w+)="([^"]*)"')  # one label of a sample: name="value"


def labeled_samples(text: str, name: str):
    """({label: value}, sample value) of every sample of the labeled metric `name` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            yield dict(LABEL.findall(labels)), float(value)


def acceptance_from_metrics(before: dict[str, list[float]], after: dict[str, list[float]]) -> Acceptance | None:
    """The run's acceptance length from two scrapes, or None if the server exposes no spec-decoding metrics."""

    def delta(name: str) -> float:
        # Sum over label sets: one series per engine (vLLM data parallel) or per tokenizer worker (SGLang).
        return sum(after.get(name, [])) - sum(before.get(name, []))

    drafts = delta(VLLM_DRAFTS)
    if drafts > 0:
        return Acceptance(1.0 + delta(VLLM_ACCEPTED) / drafts, "vllm-metrics")
    verifies = delta(SGLANG_VERIFIES)
    if verifies > 0:
        return Acceptance(delta(SGLANG_GENERATED) / verifies, "sglang-metrics")
    gauges = [v for v in after.get(SGLANG_ACCEPT_GAUGE, []) if v > 0]
    if gauges:
        return Acceptance(sum(gauges) / len(gauges), "sglang-gauge")
    return None
