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


def test_a_server_built_in_code_speculates_as_eyas_serve_does():
    """ServeConfig and SpecConfig built in code default to what `eyas serve --draft` runs: adaptive."""
    from eyas.config import SpecConfig
    from eyas.server.config import ServeConfig

    assert ServeConfig(model="demo", draft="d").spec == SpecConfig() == _config("--draft", "d").spec
    assert SpecConfig().adaptive


def test_no_draft_no_speculation_and_spec_flags_need_a_draft():
    assert _config().spec is None
    with pytest.raises(EyasError, match="need --draft"):
        _config("--spec-steps", "2")


def test_a_zero_spec_steps_or_topk_is_an_error_not_the_default(capsys):
    """0 is a value given, not a flag left out: it must fail as `eyas generate` fails, not become 3 or 1."""
    from eyas.cli import main

    with pytest.raises(EyasError, match="--spec-steps must be in 1..63, got 0"):
        _config("--draft", "d", "--spec-steps", "0")
    with pytest.raises(EyasError, match="--spec-topk must be in 1..16, got 0"):
        _config("--draft", "d", "--spec-topk", "0")
    capsys.readouterr()
    assert main(["serve", "--model", "demo", "--draft", "d", "--spec-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eyas: error: --spec-steps must be in 1..63, got 0: ") and err.count("\n") == 1


def test_steps_in_flight_default_override_and_bad_values():
    from eyas.errors import EyasError

    assert _config().steps_in_flight == 2
    assert _config("--steps-in-flight", "1").steps_in_flight == 1
    for bad in ("0", "two", "-1", ""):
        with pytest.raises(EyasError, match="--steps-in-flight must be a positive integer"):
            _config("--steps-in-flight", bad)


def test_a_bad_steps_in_flight_is_one_line_before_any_worker_starts(tmp_path):
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "eyas.cli", "serve", "--model", str(tmp_path / "none"), "--device", "cpu",
                        "--steps-in-flight", "x"], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert p.returncode == 2
    assert p.stderr.strip() == "eyas: error: --steps-in-flight must be a positive integer, not 'x'"


def test_a_bad_tokenizer_is_one_line_and_stops_the_workers_started_beside_it(tmp_path, monkeypatch, capsys):
    """The front end loads the tokenizer while the workers start: when it cannot load, the workers spawned
    beside it are stopped, and the error is the tokenizer's one line."""
    from eyas.cli import main
    from eyas.dist import launch
    from tests.helpers import tiny_llama

    tiny_llama(tmp_path)  # config and weights, no tokenizer
    groups = []
    spawn = launch.WorkerGroup.spawn
    monkeypatch.setattr(launch.WorkerGroup, "spawn", lambda self: (groups.append(self), spawn(self))[1])
    capsys.readouterr()
    code = main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "cannot load the tokenizer" in err, err
    (group,) = groups
    assert len(group.procs) == 1 and not group.procs[0].is_alive()


def _feeder_threads() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name == "QueueFeederThread"}


def test_a_failed_start_leaves_no_queue_feeder_thread_to_race_the_exit(tmp_path):
    """A Shutdown sent to a worker about to be killed started a feeder thread that, at exit, unlinked a
    semaphore without unregistering it: the resource tracker then warned of a leaked semaphore."""
    from eyas.cli import main
    from tests.helpers import tiny_llama

    tiny_llama(tmp_path)  # no tokenizer: the front end fails while the worker is still starting
    before = _feeder_threads()
    assert main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"]) == 2
    assert _feeder_threads() - before == set()


def test_a_failed_start_prints_one_line_and_no_resource_tracker_warning(tmp_path):
    import subprocess
    import sys

    from tests.helpers import tiny_llama

    tiny_llama(tmp_path)
    p = subprocess.run([sys.executable, "-m", "eyas.cli", "serve", "--model", str(tmp_path), "--device", "cpu",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "leaked semaphore" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "cannot load the tokenizer" in p.stderr, p.stderr


def test_a_port_in_use_is_one_line_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """The front end takes its port before it spawns the workers (whose rendezvous connections could take an
    ephemeral port while they start): a port in use is one line, and no worker is started."""
    import socket

    from eyas.cli import main
    from eyas.dist import launch
    from tests.helpers import tiny_llama

    tiny_llama(tmp_path)
    spawned = []
    monkeypatch.setattr(launch.WorkerGroup, "spawn", lambda self: spawned.append(self))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        capsys.readouterr()
        code = main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "the port is in use" in err, err
    assert spawned == []


def test_listen_binds_the_port_it_is_given_or_one_the_system_picks(monkeypatch):
    import socket

    from eyas.server.cli import listen

    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and sock.family == socket.AF_INET
        with pytest.raises(EyasError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            sock.listen()
            listen("127.0.0.1", port)
    finally:
        sock.close()

    def unknown(*args, **kwargs):  # as a resolver answers for a name it does not know (no DNS in the test)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(EyasError, match="cannot listen on no-such-host:8000: .*not known"):
        listen("no-such-host", 8000)
