"""Every `eyas bench` is recorded in the ledger (kind "bench"), unless --no-record, and recording never breaks it."""

import pytest

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.ledger.ledger import Ledger
from tests.bench.conftest import StubState, build_app, serving


@pytest.fixture(scope="module")
def stub_url():
    with serving(build_app(StubState())) as url:
        yield url


def bench(url, prompts, *extra):
    return main(["bench", "--url", url, "--dataset", str(prompts), "--num-prompts", "2", "--max-tokens", "8",
                 "--json", *extra])


def test_bench_is_recorded(stub_url, prompts, capsys, home):
    assert bench(stub_url, prompts) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and "recorded as run" in err  # stdout stays one JSON object
    with Ledger() as ledger:
        [run] = ledger.list()
    assert run.kind == "bench" and run.status == "ok" and run.argv[:2] == ["eyas", "bench"]
    assert run.results["completed"] == 2 and run.results["output_tok_s"] > 0 and "tpot_ms_p50" in run.results
    assert run.config["url"] == stub_url and run.config["api_key"] is None


def test_no_record_and_a_broken_ledger_do_not_stop_the_bench(stub_url, prompts, capsys, home, monkeypatch):
    assert bench(stub_url, prompts, "--no-record") == 0
    assert not (home / "runs.db").exists()
    blocker = home.parent / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("EYAS_HOME", str(blocker))  # the ledger cannot be created under a file
    capsys.readouterr()
    assert bench(stub_url, prompts) == 0
    out, err = capsys.readouterr()
    assert '"completed": 2' in out and "warning: not recorded in the run ledger" in err


def test_a_failed_bench_is_recorded_as_failed(prompts, capsys, home):
    assert bench(f"http://127.0.0.1:{free_port()}", prompts) == 2
    with Ledger() as ledger:
        [run] = ledger.list()
    assert run.status == "failed" and "cannot reach" in run.results["error"]
