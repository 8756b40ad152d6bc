"""With one step queued at the workers (eyas serve --steps-in-flight 1; two is the default), concurrent greedy
requests get what each gets alone, and a stop string still cuts the text where it first appears. The same
with two (where a stop's abort lands a step later, and that step's tokens are dropped) is test_api.py's: its
server runs with two pinned, and its concurrent-requests and stop-string tests check exactly this."""

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.server.tiny import Server


def test_one_step_in_flight_changes_no_text(tiny_model):
    with Server(tiny_model, "--max-running", "8", "--steps-in-flight", "1") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def one(i):
            r = client.completions.create(model=server.model, prompt=f"Request {i}: the {'abc'[i % 3]}",
                                          max_tokens=6 + i % 13, temperature=0)
            return r.choices[0].text, r.usage.completion_tokens

        alone = [one(i) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            together = list(pool.map(one, range(12)))
        assert together == alone

        def go_on(**kw):
            return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Go on."}],
                                                  max_tokens=40, temperature=0, **kw).choices[0]

        text = go_on().message.content
        assert len(text) > 13
        stop = text[10:13]
        cut = go_on(stop=[stop])
        assert cut.message.content == text[:text.index(stop)] and cut.finish_reason == "stop"
