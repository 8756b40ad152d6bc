"""A real OpenSSH server on 127.0.0.1, started by the tests (skipped, with the reason, where that is impossible)."""

import pytest

from tests.launch.conftest import home, prompts, tiny  # noqa: F401  (shared fixtures)
from tests.remote.sshd import Sshd, unavailable


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()
