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
