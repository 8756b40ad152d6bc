"""Fixtures shared across test packages."""

import os
import tempfile

import pytest

# Tests never touch the user's ledger or caches: one throwaway $EYAS_HOME per test session, set before any
# test (or server subprocess it starts) reads it. Tests that need their own home monkeypatch it further.
_SESSION_HOME = tempfile.mkdtemp(prefix="eyas-test-home-")
os.environ["EYAS_HOME"] = _SESSION_HOME

# Triton kernels (eyas.kernels) run on the CPU through Triton's interpreter in tests. The flag is read when
# a kernel is decorated, i.e. when its module is first imported, so it is set here, before any test module
# imports eyas. With EYAS_TEST_CUDA=1 (on a GPU machine) the kernels compile for the GPU instead.
if os.environ.get("EYAS_TEST_CUDA") != "1":
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def demo_dir():
    """The converted SmolLM2 demo checkpoint (float32), converted once per test session."""
    from eyas.models.demo import demo_model_path

    return demo_model_path()
