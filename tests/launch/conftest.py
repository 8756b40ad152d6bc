"""Fixtures for the launch tests: a private ledger, a tiny TP-able chat model, a prompt file, free ports."""

import json
import sys

import pytest

from eyas.dist.launch import free_port
from tests.server.tiny import tiny_chat_model


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test gets its own $EYAS_HOME (ledger, launch logs); launched servers inherit it as a base variable."""
    path = tmp_path / "eyas_home"
    monkeypatch.setenv("EYAS_HOME", str(path))
    return path


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    """A launch here checks /health every 0.1 s instead of 0.5 s, and whether the server died every 0.25 s instead
    of 2 s (a local check reads /proc; the 2 s spare ssh round trips): a ready or dead server is seen sooner."""
    import eyas.launch.launch as launch

    monkeypatch.setattr(launch, "HEALTH_POLL_S", 0.1)
    monkeypatch.setattr(launch, "ALIVE_POLL_S", 0.25)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    # The demo SmolLM2 has 9 attention heads, which TP=2 cannot split; this model has 4.
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello there", "The parser reads", "os and"]))
    return path


def write_config(path, **fields) -> str:
    """A launch config for the eyas backend on CPU; `bench` is a dict for the [bench] table."""
    from eyas.launch.launch_config import LaunchConfig

    fields.setdefault("backend", "eyas")
    fields.setdefault("port", free_port())
    fields.setdefault("python", sys.executable)
    fields.setdefault("extra_args", ["--device", "cpu"])
    fields.setdefault("startup_timeout_s", 180.0)
    path.write_text(LaunchConfig(**fields).to_toml())
    return str(path)


def run_id_of(stdout: str) -> str:
    """The id from `eyas launch`'s summary line: `run 3-20261129-120000: ok, ...`."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith("run "))
    return line.split()[1].rstrip(":")
