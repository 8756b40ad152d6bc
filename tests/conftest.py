"""Fixtures shared across test packages."""

import os
import tempfile

import pytest

# Tests never touch the user's ledger or caches: one throwaway $EYAS_HOME per test session, set before any
# test (or server subprocess it starts) reads it. Tests that need their own home monkeypatch it further.
_SESSION_HOME = tempfile.mkdtemp(prefix="eyas-test-home-")
os.environ["EYAS_HOME"] = _SESSION_HOME


@pytest.fixture(scope="session")
def demo_dir():
    """The converted SmolLM2 demo checkpoint (float32), converted once per test session."""
    from eyas.models.demo import demo_model_path

    return demo_model_path()
