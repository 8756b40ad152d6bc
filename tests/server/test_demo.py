"""The embedded demo model (SmolLM2-135M-Instruct, fp32, CPU) answers a chat request through `eyas serve`."""

import openai
import pytest

from tests.server.tiny import Server

demo = pytest.importorskip("eyas.models.demo")


def test_demo_chat_completion():
    demo.demo_model_path()  # convert once outside the server's start-up clock
    with Server("demo", "--dtype", "fp32", "--max-running", "2", "--max-model-len", "256") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="demo", temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = r.choices[0].message.content
        assert "Paris" in answer
        assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
