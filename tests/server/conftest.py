"""Fixtures for the server tests: the tiny chat checkpoint and a plain in-process Engine as the reference."""

import pytest

from tests.server.tiny import tiny_chat_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from eyas.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def reference(tiny_model, tokenizer):
    """prompt ids -> the text a lone greedy request gets from the library Engine at TP=1."""
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams

    engine = Engine(str(tiny_model), dtype="fp32", device="cpu", max_batch=1, max_len=512)

    def run(prompt_ids, max_tokens):
        [seq] = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
        return tokenizer.decode(seq.output_ids, skip_special_tokens=True), seq

    return run
