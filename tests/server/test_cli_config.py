"""`eyas serve` flags -> ServeConfig: with a draft the server is adaptive unless told otherwise."""

import argparse

import pytest

from eyas.errors import EyasError
from eyas.server.cli import add_arguments, config_from_args


def _config(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--model", "demo", *argv]))


def test_a_draft_serves_adaptively_by_default():
    cfg = _config("--draft", "d")
    assert cfg.spec.adaptive and (cfg.spec.steps, cfg.spec.topk) == (3, 1)
    assert _config("--draft", "d", "--spec-steps", "5", "--spec-topk", "4").spec.adaptive


def test_no_spec_adaptive_speculates_every_step():
    assert not _config("--draft", "d", "--no-spec-adaptive").spec.adaptive


def test_no_draft_no_speculation_and_spec_flags_need_a_draft():
    assert _config().spec is None
    with pytest.raises(EyasError, match="need --draft"):
        _config("--spec-steps", "2")


def test_steps_in_flight_default_override_and_bad_values(monkeypatch):
    from eyas.errors import EyasError
    from eyas.server.scheduler import steps_in_flight

    monkeypatch.delenv("EYAS_STEPS_IN_FLIGHT", raising=False)
    assert steps_in_flight() == 2
    monkeypatch.setenv("EYAS_STEPS_IN_FLIGHT", "1")
    assert steps_in_flight() == 1
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("EYAS_STEPS_IN_FLIGHT", bad)
        with pytest.raises(EyasError, match="EYAS_STEPS_IN_FLIGHT must be a positive integer"):
            steps_in_flight()


def test_a_bad_steps_in_flight_is_one_line_before_any_worker_starts(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, EYAS_STEPS_IN_FLIGHT="x")
    p = subprocess.run([sys.executable, "-m", "eyas.cli", "serve", "--model", str(tmp_path / "none"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2
    assert p.stderr.strip() == "eyas: error: EYAS_STEPS_IN_FLIGHT must be a positive integer, not 'x'"
