"""Kernel tests: Triton's interpreter on the CPU (TRITON_INTERPRET is set in tests/conftest.py), or the
compiled kernels on a GPU with EYAS_TEST_CUDA=1."""

import os

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]' brings it)")


@pytest.fixture(scope="session")  # session-wide, so module fixtures (models built once) can use it too
def device():
    import torch

    return "cuda" if os.environ.get("EYAS_TEST_CUDA") == "1" and torch.cuda.is_available() else "cpu"
