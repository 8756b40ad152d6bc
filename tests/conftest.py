"""Fixtures shared across test packages."""

import pytest


@pytest.fixture(scope="session")
def demo_dir():
    """The converted SmolLM2 demo checkpoint (float32), converted once per $EYAS_HOME and reused across sessions."""
    from eyas.models.demo import demo_model_path

    return demo_model_path()
