"""A speculative server (EAGLE-3 draft replicated on both TP ranks) returns the plain greedy text and reports
acceptance; several tokens per step flow through streaming and stop strings unchanged."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from eyas.bench.prometheus import labeled_samples, parse_metrics
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from tests.server.tiny import Server


def plain_texts(target, tokenizer, prompts, max_tokens=40):
    """What the target alone writes for each prompt, greedy, one at a time."""
    plain = Engine(str(target), dtype="fp32", max_batch=1, max_len=512)
    return [tokenizer.decode(plain.generate([tokenizer.encode(p)], SamplingParams(max_tokens=max_tokens))[0]
                             .output_ids, skip_special_tokens=True) for p in prompts]


def test_speculative_tp2_server_equals_plain_greedy(pair, tokenizer):
    target, draft = pair
    prompts = [f"Draft {i}: the parser and the {'abc'[i % 3]}" for i in range(6)]
    want = plain_texts(target, tokenizer, prompts)
    # Every step speculates: under the adaptive policy (the default) a loaded CI machine can measure plain steps
    # as faster and take some, and the per-request acceptance asserted below then depends on timing.
    args = ["--draft", str(draft), "--spec-steps", "3", "--spec-topk", "2", "--spec-draft-tokens", "5",
            "--tp", "2", "--max-running", "3", "--profile", "--no-spec-adaptive"]
    with Server(target, *args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=180)

        def one(p):
            return client.completions.create(model=server.model, prompt=p, max_tokens=40, temperature=0)

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, prompts))
        assert [r.choices[0].text for r in got] == want
        for r in got:
            u = r.usage.model_extra
            assert 1 <= u["verify_passes"] < r.usage.completion_tokens - 1  # several tokens per pass
            assert u["accept_length"] == pytest.approx((r.usage.completion_tokens - 1) / u["verify_passes"], abs=1e-4)
            assert u["accept_length"] > 1.5
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        passes = sum(r.usage.model_extra["verify_passes"] for r in got)
        tokens = sum(r.usage.completion_tokens for r in got)
        assert m["eyas_spec_verify_passes_total"] == [passes]
        assert m["eyas_spec_accepted_tokens_total"] == [tokens - len(got) - passes]
        # Steps by mode and batch bucket: each step verified 1..3 (max running) sequences at once.
        assert passes / 3 <= sum(m["eyas_spec_steps_total"]) <= passes
        text = httpx.get(server.url + "/metrics").text
        assert 'phase="draft"' in text and 'phase="verify"' in text  # --profile exports the cycle's phases

        # Streaming: chunks now carry several tokens, and the text is still the same.
        chunks = list(client.completions.create(model=server.model, prompt=prompts[0], max_tokens=40,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want[0]
        assert len([c for c in chunks if c.choices[0].text]) < got[0].usage.completion_tokens
        # A stop string that falls inside a multi-token step still cuts exactly there.
        stop = want[0][7:10]
        cut = client.completions.create(model=server.model, prompt=prompts[0], max_tokens=40, temperature=0,
                                        stop=stop)
        assert cut.choices[0].text == want[0][:want[0].index(stop)] and cut.choices[0].finish_reason == "stop"
        info = httpx.get(server.url + "/server_info").json()
        assert info["model"]["speculative"] and info["config"]["spec"]["topk"] == 2


def test_adaptive_speculation_with_tensor_parallelism_stays_lossless(pair, tokenizer):
    """Each rank times its own steps; every rank follows rank 0's choice, so the lockstep holds."""
    target, draft = pair
    prompts = [f"Adaptive {i}: the parser and the {'abc'[i % 3]}" for i in range(4)]
    want = plain_texts(target, tokenizer, prompts)
    with Server(target, "--draft", str(draft), "--spec-adaptive", "--tp", "2", "--max-running", "4") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=180)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.completions.create(model=server.model, prompt=p, max_tokens=40,
                                                                    temperature=0), prompts))
        assert [r.choices[0].text for r in got] == want
        # The policy's measurements reach /metrics (sent when the engine goes idle): a rate for each mode
        # it measured at some batch bucket; speculation is measured first.
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        assert m["eyas_spec_rate_tokens_per_second"] and all(r > 0 for r in m["eyas_spec_rate_tokens_per_second"])
        text = httpx.get(server.url + "/metrics").text
        assert 'eyas_spec_rate_tokens_per_second{bucket="' in text and 'mode="speculative"' in text
        # ... and its books: speculation ran and produced tokens, the prompts' prefills were booked apart.
        books = {name: {labels["mode"]: value for labels, value in labeled_samples(text, name)}
                 for name in ("eyas_spec_policy_seconds", "eyas_spec_policy_tokens")}
        assert books["eyas_spec_policy_seconds"]["speculative"] > 0 and books["eyas_spec_policy_tokens"]["speculative"] > 0
        assert books["eyas_spec_policy_seconds"]["prefill"] > 0
        # Every prompt was prefilled in some step, and those steps are timed apart.
        assert m["eyas_joined_requests_total"] == [len(prompts)]
        joins = [v for labels, v in labeled_samples(text, "eyas_cycle_ms_count") if labels["phase"] == "step_with_joins"]
        assert 1 <= joins[0] <= len(prompts)
