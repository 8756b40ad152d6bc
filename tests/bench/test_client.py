"""The load generator against the stub server in conftest.py: timing, token counts, load shapes, errors, acceptance."""

import json
import statistics

import pytest

from eyas.bench import BenchConfig, run_benchmark
from eyas.bench.client import poisson_arrivals
from eyas.errors import EyasError


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(12)))
    return str(path)


def bench(url, dataset, **kw):
    kw.setdefault("warmup", 0)
    return run_benchmark(BenchConfig(url=url, dataset=dataset, progress=False, **kw))


def test_timing_tokens_and_usage_acceptance(stub, prompts_file):
    state, url = stub
    state.config.tokens, state.config.tokens_per_chunk = 8, 2
    state.config.ttft_s, state.config.chunk_gap_s = 0.10, 0.03
    r = bench(url, prompts_file, num_prompts=6, concurrency=2, max_tokens=8, temperature=0.5, seed=7, api_key="sk-x")

    assert (r.completed, r.errors) == (6, 0)
    assert r.total_output_tokens == 6 * 8 and r.total_prompt_tokens == 6 * 5
    assert r.output_tokens_source == "usage"
    # 4 chunks of 2 tokens: 100 ms to the first, then 3 gaps of 30 ms. Loopback adds little; bounds stay generous.
    assert 90 <= r.ttft_ms.mean <= 600
    assert 25 <= r.itl_ms.p50 <= 300
    assert r.ttft_ms.mean + 80 <= r.e2e_ms.mean <= 1500
    # TPOT is per token from usage: 3 gaps spread over 7 tokens, not 3 chunks.
    assert 10 <= r.tpot_ms.mean <= 100 and r.tpot_ms.mean < r.itl_ms.mean
    assert r.accept_length == pytest.approx(7 / 4) and r.accept_source == "usage"
    assert 0 < r.output_tok_s and r.request_s == pytest.approx(6 / r.duration_s)

    body = state.bodies[0]
    assert state.paths[0] == "/v1/chat/completions"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"]) == ("stub-model", 8, 0.5, 7)
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith("question ")
    assert set(state.auth) == {"Bearer sk-x"}
    assert r.config["model"] == "stub-model" and r.config["api_key"] == "***"
    assert json.loads(json.dumps(r.to_dict()))["ttft_ms"]["p99"] >= r.ttft_ms.p50


def test_concurrency_is_bounded(stub, prompts_file):
    state, url = stub
    state.config.ttft_s, state.config.chunk_gap_s = 0.05, 0.01
    r = bench(url, prompts_file, num_prompts=12, concurrency=3)
    assert r.completed == 12
    assert state.max_in_flight == 3


def test_request_rate_follows_seeded_poisson_schedule(stub, prompts_file):
    state, url = stub
    state.config.ttft_s, state.config.chunk_gap_s = 0.02, 0.005
    r = bench(url, prompts_file, num_prompts=10, request_rate=20.0, seed=3)
    assert r.completed == 10 and r.config["request_rate"] == 20.0
    want = poisson_arrivals(10, 20.0, seed=3)
    got = [t - state.arrivals[0] for t in state.arrivals]
    assert max(abs(g - w) for g, w in zip(got, want)) < 0.15
    assert r.duration_s >= want[-1]


def test_poisson_arrivals_are_seeded_and_have_the_right_rate():
    a = poisson_arrivals(4000, 50.0, seed=1)
    assert a == poisson_arrivals(4000, 50.0, seed=1) and a != poisson_arrivals(4000, 50.0, seed=2)
    assert a[0] == 0.0
    assert statistics.mean(b - x for x, b in zip(a, a[1:])) == pytest.approx(1 / 50.0, rel=0.1)


def test_warmup_is_sent_but_not_counted(stub, prompts_file):
    state, url = stub
    r = bench(url, prompts_file, num_prompts=4, concurrency=2, warmup=3)
    assert state.requests == 7
    assert r.completed == 4 and r.total_output_tokens == 4 * 8


def test_errors_are_counted_not_fatal(stub, prompts_file):
    state, url = stub
    state.config.fail_every = 3
    r = bench(url, prompts_file, num_prompts=9, concurrency=1)
    assert (r.completed, r.errors) == (6, 3)
    assert sum(r.error_messages.values()) == 3
    assert all(m.startswith("HTTP 500: stub failure on request") for m in r.error_messages)
    assert r.total_output_tokens == 6 * 8
    assert "error x1: HTTP 500" in r.table()


def test_failed_warmup_is_one_clear_error(stub, prompts_file):
    state, url = stub
    state.config.fail_every = 1
    with pytest.raises(EyasError, match="warm-up.*HTTP 500"):
        bench(url, prompts_file, num_prompts=2, warmup=2)


@pytest.mark.parametrize("style, want, source", [
    ("vllm", 2.0, "vllm-metrics"),  # 1 + accepted/drafts over the run's deltas
    ("sglang", 2.0, "sglang-metrics"),  # generated/verify calls; the 9.5 gauge is ignored
    ("sglang-gauge", 3.25, "sglang-gauge"),
])
def test_acceptance_from_metrics_when_usage_has_none(stub, prompts_file, style, want, source):
    state, url = stub
    state.config.spec_usage, state.config.metrics = False, style
    r = bench(url, prompts_file, num_prompts=4, concurrency=2, warmup=1)
    assert r.accept_length == pytest.approx(want) and r.accept_source == source


def test_no_acceptance_anywhere_is_none(stub, prompts_file):
    state, url = stub
    state.config.spec_usage = False
    r = bench(url, prompts_file, num_prompts=2)
    assert r.accept_length is None and r.accept_source is None
    assert "n/a" in r.table()


def test_missing_usage_falls_back_to_chunks_and_says_so(stub, prompts_file):
    state, url = stub
    state.config.usage = False
    r = bench(url, prompts_file, num_prompts=3)
    assert r.total_output_tokens == 3 * 4  # 4 chunks each, though the server produced 8 tokens
    assert r.output_tokens_source == "chunks for 3 of 3 responses without usage"


def test_completions_endpoint_sends_raw_text(stub, prompts_file):
    state, url = stub
    r = bench(url + "/v1/", prompts_file, num_prompts=2, endpoint="completions", model="named")
    assert r.completed == 2 and r.total_output_tokens == 16
    assert state.paths == ["/v1/completions"] * 2
    assert state.bodies[0]["prompt"].startswith("question ") and state.bodies[0]["model"] == "named"
