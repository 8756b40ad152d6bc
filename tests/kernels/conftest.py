"""Kernel tests: Triton's interpreter on the CPU (TRITON_INTERPRET is set in tests/conftest.py), or the
compiled kernels on a GPU with EYAS_TEST_CUDA=1."""

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]' brings it)")
