"""`eyas launch` and `eyas tune` call their TOML file a launch config; "spec" means speculative settings only."""

import re

import pytest

from eyas.cli import main
from eyas.launch.launch_config import load_config
from tests.launch.conftest import write_config


def _help(capsys, verb: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([verb, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("verb", ["launch", "tune"])
def test_help_names_the_toml_a_launch_config(capsys, verb):
    text = _help(capsys, verb)
    assert "CONFIG.toml" in text and "the launch config" in text
    assert not re.search(r"\bspec\b", text, re.IGNORECASE), text


@pytest.fixture
def swept(monkeypatch):
    """The (config, command line) each `eyas tune` hands to the sweep, which never starts."""
    import eyas.ledger.tune

    calls = []

    def record(config, points, env_sets, host, ledger, launched_by):
        calls.append((config, launched_by))
        return "sweep", []

    monkeypatch.setattr(eyas.ledger.tune, "run_sweep", record)
    return calls


def test_tune_reads_the_same_config_from_config_and_from_the_old_spec_flag(tmp_path, capsys, swept):
    path = write_config(tmp_path / "t.toml", model="/m", draft="/d", bench={"dataset": "mt-bench", "num_prompts": 1})
    for flag in ("--config", "--spec"):  # --spec: the spelling of command lines already in run ledgers
        assert main(["tune", flag, path, "--steps", "2", "--db", str(tmp_path / "runs.db")]) == 1  # no point ran
    (new, new_argv), (old, old_argv) = swept
    assert new == old == load_config(path)
    assert new_argv[2] == "--config" and old_argv[2] == "--spec"  # the ledger keeps the line as typed


def test_tune_without_a_config_names_the_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["tune", "--steps", "2"])
    assert stop.value.code == 2 and "--config" in capsys.readouterr().err
