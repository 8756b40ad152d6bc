"""vLLM 0.32 (its CPU build) runs eyas's exported draft as eyas does: same greedy tokens, same acceptance.

One `vllm serve` of the demo target with the shipped draft exported in the speculators layout (the layout vLLM
loads), fp32, EAGLE-3 chain of 3 drafted tokens. Prompts are eyas's own chat-templated token ids, sent to
/v1/completions so both engines run identical inputs. vLLM's acceptance comes from its own /metrics counters
(`vllm:spec_decode_num_drafts_total`: its verify passes; `..._num_accepted_tokens_total`), eyas's from its engine
(generated tokens after the first / verify passes). vLLM's own figure, 1 + accepted / drafts, also counts the
drafted tokens accepted past max_tokens and then cut off (measured +3% at 4 x 48 tokens), so the two are compared
on emitted tokens per verify pass, and vLLM's pass count must be eyas's exactly. Plain vLLM decoding equals eyas's greedy tokens too:
tests/peers/test_vllm_capture.py checks it on the server it starts.
"""

from pathlib import Path

import httpx
import pytest
import torch

from eyas.bench.datasets import load_prompts
from eyas.bench.prometheus import VLLM_DRAFTS, acceptance_from_metrics, parse_metrics
from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from eyas.models.demo import demo_model_path
from eyas.models.draft_io import load_draft, save_draft
from eyas.models.tokenizer import encode_messages, load_tokenizer
from eyas.train.target import TargetHeads
from tests.peers.envs import vllm_server

DRAFT = Path(__file__).resolve().parents[2] / "assets" / "smollm2-135m-eagle3"
PROMPTS, TOKENS, STEPS = 4, 48, 3
ACCEPT_RTOL = 0.03


@pytest.fixture(scope="module")
def demo():
    return str(demo_model_path())


@pytest.fixture(scope="module")
def prompts(demo):
    tok = load_tokenizer(demo)
    return [encode_messages(tok, p.messages) for p in load_prompts("mt-bench", PROMPTS, seed=0)]


@pytest.fixture(scope="module")
def draft_dir(demo, tmp_path_factory):
    """The shipped draft as eyas exports it for vLLM: speculators layout, fp32, the target's embedding inside."""
    from eyas.config import ModelConfig

    draft = load_draft(DRAFT, ModelConfig.from_dir(demo))
    embedding = TargetHeads.load(demo, torch.float32, "cpu").embed_weight
    return save_draft(draft, tmp_path_factory.mktemp("draft") / "speculators", "speculators", verifier=demo,
                      dtype=torch.float32, speculative_tokens=STEPS, embedding=embedding)


@pytest.fixture(scope="module")
def vllm(demo, draft_dir, prompts, tmp_path_factory):
    """vLLM's tokens for every prompt and its acceptance length over exactly these requests."""
    import json

    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": STEPS}
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm_server(demo, "--speculative-config", json.dumps(spec), log=log) as url:
        with httpx.Client(base_url=url, timeout=600, trust_env=False) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            before = parse_metrics(client.get("/metrics").text)
            tokens = []
            for ids in prompts:  # one at a time: the same batches as eyas's, whatever the scheduler would merge
                body = {"model": model, "prompt": ids, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
                        "return_token_ids": True}
                choice = client.post("/v1/completions", json=body).json()["choices"][0]
                assert choice["prompt_token_ids"] == ids
                tokens.append(choice["token_ids"])
            after = parse_metrics(client.get("/metrics").text)
    accept = acceptance_from_metrics(before, after)
    assert accept is not None and accept.source == "vllm-metrics", "vLLM counted no drafts: it did not speculate"
    drafts = sum(after[VLLM_DRAFTS]) - sum(before[VLLM_DRAFTS])
    return tokens, drafts, accept.length


def _eyas(demo, prompts, draft=None):
    engine = Engine(demo, dtype="fp32", device="cpu", draft=draft,
                    spec=SpecConfig(STEPS, 1, adaptive=False) if draft else None,
                    max_batch=1, max_len=max(map(len, prompts)) + TOKENS + 2 * STEPS + 8)
    seqs = [engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0] for ids in prompts]
    return [s.output_ids for s in seqs], sum(s.verify_passes for s in seqs)


def test_vllm_with_eyas_draft_emits_eyas_greedy_tokens(demo, prompts, vllm):
    plain, _ = _eyas(demo, prompts)
    assert vllm[0] == plain


def test_vllm_acceptance_equals_eyas_within_3_percent(demo, draft_dir, prompts, vllm):
    tokens, passes = _eyas(demo, prompts, str(draft_dir))  # the very files vLLM loaded
    vllm_tokens, vllm_drafts, vllm_reported = vllm
    assert tokens == vllm_tokens
    emitted = sum(len(t) - 1 for t in tokens)  # the first token comes from the prefill, in both engines
    accept = emitted / passes
    assert accept > 1.2  # the shipped draft drafts: a broken export would accept ~1.0 in both engines
    assert vllm_drafts == passes
    assert emitted / vllm_drafts == pytest.approx(accept, rel=ACCEPT_RTOL)
    assert vllm_reported >= emitted / vllm_drafts  # its own figure adds the accepted tokens cut at max_tokens
