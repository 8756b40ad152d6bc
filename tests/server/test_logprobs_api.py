"""`logprobs` / `top_logprobs` through the official openai client: the target's log-probabilities of the emitted
tokens, the same from a plain server and a speculative one (greedy), and for sampled text equal to a
teacher-forced pass over the text each server wrote."""

import httpx
import openai
import pytest
import torch

from tests.server.tiny import Server, predictable_pair

QUESTION = "Describe the parser."


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lp-api")
    return predictable_pair(root / "target", root / "draft")


@pytest.fixture(scope="module")
def servers(pair):
    target, draft = pair
    with Server(target) as plain, Server(target, "--draft", str(draft), "--no-spec-adaptive") as spec:
        yield {"plain": plain, "spec": spec}


@pytest.fixture(scope="module")
def clients(servers):
    return {k: openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=180)
            for k, s in servers.items()}


@pytest.fixture(scope="module")
def reference(pair):
    """(prompt ids, output ids) -> the target's log_softmax rows at each output position, teacher-forced."""
    from eyas.engine.engine import Engine
    from eyas.models.tokenizer import load_tokenizer

    engine = Engine(str(pair[0]), dtype="fp32", device="cpu", max_batch=1, max_len=512)

    def rows(prompt, output):
        ids = torch.tensor([prompt + output[:-1]])
        out = engine.runner.forward(ids, torch.arange(ids.shape[1])[None], [0], [0])
        return torch.log_softmax(engine.target.logits(out.hidden[0, len(prompt) - 1:]).float(), -1)

    return rows, load_tokenizer(pair[0])


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=20, logprobs=True, extra_body={"ignore_eos": True}, **kw)


def token_ids(tokenizer, content) -> list[int]:
    """Token ids back from chat logprobs' `bytes` (byte-level BPE: a token's bytes name its vocabulary entry)."""
    from eyas.server.logprobs import _byte_decoder

    encoder = {b: c for c, b in _byte_decoder().items()}
    return tokenizer.convert_tokens_to_ids(["".join(encoder[b] for b in c.bytes) for c in content])


def check_teacher_forced(reference, response, top):
    rows, tokenizer = reference
    content = response.choices[0].logprobs.content
    ids = token_ids(tokenizer, content)
    assert tokenizer.decode(ids, skip_special_tokens=True) == response.choices[0].message.content
    assert len(content) == response.usage.completion_tokens == 20
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    ref = rows(list(prompt), ids)
    for i, (t, c) in enumerate(zip(ids, content)):
        assert c.logprob == pytest.approx(ref[i, t].item(), abs=1e-4)
        assert len(c.top_logprobs) == top
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(ref[i].topk(top).values.tolist(), abs=1e-4)


def test_chat_greedy_logprobs_equal_with_and_without_speculation(servers, clients, reference):
    got = {k: chat(clients[k], servers[k].model, temperature=0, top_logprobs=3) for k in servers}
    plain, spec = got["plain"].choices[0], got["spec"].choices[0]
    assert got["spec"].usage.accept_length > 1.2  # drafts were accepted, so verify rows were read
    assert spec.message.content == plain.message.content
    assert [c.token for c in spec.logprobs.content] == [c.token for c in plain.logprobs.content]
    assert [c.logprob for c in spec.logprobs.content] == pytest.approx([c.logprob for c in plain.logprobs.content],
                                                                       abs=1e-5)
    for r in got.values():
        check_teacher_forced(reference, r, 3)


def test_chat_sampled_logprobs_are_the_targets(servers, clients, reference):
    for k in servers:
        r = chat(clients[k], servers[k].model, temperature=0.9, seed=11, top_logprobs=2)
        check_teacher_forced(reference, r, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_shape_and_agreement(servers, clients, stream):
    got = {}
    for k in servers:
        kw = dict(model=servers[k].model, prompt="the parser reads", max_tokens=12, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
        if stream:
            chunks = list(clients[k].completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens, lps, offsets = [], [], []
            for c in chunks:
                if c.choices and c.choices[0].logprobs:
                    tokens += c.choices[0].logprobs.tokens
                    lps += c.choices[0].logprobs.token_logprobs
                    offsets += c.choices[0].logprobs.text_offset
        else:
            r = clients[k].completions.create(**kw)
            text, lp = r.choices[0].text, r.choices[0].logprobs
            tokens, lps, offsets = lp.tokens, lp.token_logprobs, lp.text_offset
            assert all(len(alt) == 2 and max(alt.values()) >= lps[i] - 1e-6 for i, alt in enumerate(lp.top_logprobs))
        assert len(tokens) == len(lps) == len(offsets) == 12 and "".join(tokens) == text
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(12)]
        got[k] = (tokens, lps)
    assert got["spec"][0] == got["plain"][0]
    assert got["spec"][1] == pytest.approx(got["plain"][1], abs=1e-5)


def test_no_logprobs_unless_asked_and_top_logprobs_needs_logprobs(servers, clients):
    r = clients["spec"].chat.completions.create(model=servers["spec"].model, max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].logprobs is None
    body = {"model": servers["plain"].model, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    bad = httpx.post(servers["plain"].url + "/v1/chat/completions", json=body)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    body = {"model": servers["plain"].model, "prompt": "hi", "logprobs": 21}
    bad = httpx.post(servers["plain"].url + "/v1/completions", json=body)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
