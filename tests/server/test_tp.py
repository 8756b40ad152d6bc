"""TP=2 over gloo: two lockstep workers give exactly the TP=1 greedy outputs, batched or not."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.server.tiny import Server


def test_tp2_equals_tp1(tiny_model, tokenizer, reference):
    prompts = [f"Worker {i} reads {'xyz'[i % 3]} and" for i in range(6)]
    lengths = [10 + 3 * i for i in range(6)]
    want = [reference(tokenizer.encode(p), n)[0] for p, n in zip(prompts, lengths)]
    with Server(tiny_model, "--tp", "2", "--max-running", "4") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=180)

        def one(i):
            r = client.completions.create(model=server.model, prompt=prompts[i], max_tokens=lengths[i], temperature=0)
            return r.choices[0].text

        assert [one(i) for i in range(6)] == want
        with ThreadPoolExecutor(6) as pool:  # batched, with queueing: 6 requests over 4 slots
            assert list(pool.map(one, range(6))) == want

        # Sampling: each rank draws with its own generator, seeded the same, so the ranks agree and a seed repeats.
        sample = lambda **kw: client.completions.create(model=server.model, prompt="Pick", max_tokens=12,
                                                        temperature=1.0, **kw).choices[0].text
        assert sample(seed=3) == sample(seed=3)
        assert isinstance(sample(), str)  # no seed: the front end picks one for all ranks

        workers = httpx.get(server.url + "/server_info").json()["workers"]
        assert [w["rank"] for w in workers] == [0, 1] and workers[0]["pid"] != workers[1]["pid"]
