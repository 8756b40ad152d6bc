"""The tiny chat checkpoint, shared with the server tests' builder."""

import pytest

from tests.server.tiny import tiny_chat_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
