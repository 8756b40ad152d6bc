import pytest

from eyas.ledger.ledger import Ledger


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test gets its own $EYAS_HOME, so the user's ledger is never touched."""
    path = tmp_path / "eyas_home"
    monkeypatch.setenv("EYAS_HOME", str(path))
    return path


@pytest.fixture
def ledger(home):
    with Ledger() as ledger:
        yield ledger
