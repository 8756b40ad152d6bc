"""`eyas bench` through the real entry point: table, --json, and one-line errors with exit code 2."""

import json

import pytest

from eyas.bench.config import BenchConfig
from eyas.bench.prometheus import labeled_samples, parse_metrics
from eyas.bench.report import percentile
from eyas.cli import main
from eyas.errors import EyasError


def test_unreachable_url_is_one_line_and_exit_2(capsys, unused_port):
    port = unused_port
    rc = main(["bench", "--url", f"http://127.0.0.1:{port}", "--dataset", "mt-bench", "--num-prompts", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and err.startswith(f"eyas: error: cannot reach http://127.0.0.1:{port}")


@pytest.mark.parametrize("argv, match", [
    (["--url", "localhost:8000"], "must start with http"),
    (["--url", "http://x", "--concurrency", "0"], "--concurrency must be at least 1"),
    (["--url", "http://x", "--request-rate", "-1"], "--request-rate must be positive"),
    (["--url", "http://x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, match):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err


def test_concurrency_and_rate_together_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--url", "http://x", "--concurrency", "2", "--request-rate", "3"])
    assert e.value.code == 2
    with pytest.raises(EyasError, match="not both"):
        BenchConfig(url="http://x", concurrency=2, request_rate=3.0)


def test_json_output_is_one_object(stub, capsys):
    state, url = stub
    rc = main(["bench", "--url", url, "--dataset", "humaneval", "--num-prompts", "3", "--concurrency", "3",
               "--max-tokens", "8", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("\n") == 1
    d = json.loads(out)
    assert d["completed"] == 3 and d["errors"] == 0 and d["accept_length"] == pytest.approx(7 / 4)
    assert set(d["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert d["config"]["dataset"] == "humaneval" and d["config"]["model"] == "stub-model"
    assert state.requests == 4  # one warm-up by default


def test_table_output(stub, capsys):
    state, url = stub
    rc = main(["bench", "--url", url, "--dataset", "mt-bench", "--num-prompts", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("output tok/s", "accept length", "TTFT", "ITL (per chunk)", "TPOT (per token)", "E2E"):
        assert label in out
    assert "1.750  (usage)" in out and "concurrency 1 (closed loop)" in out


def test_all_requests_failing_exits_1(stub, capsys):
    state, url = stub
    state.config.fail_every = 1
    assert main(["bench", "--url", url, "--dataset", "mt-bench", "--num-prompts", "2", "--warmup", "0"]) == 1
    assert "completed / errors  0 / 2" in capsys.readouterr().out


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(xs, 0), percentile(xs, 50), percentile(xs, 100)) == (1.0, 3.0, 5.0)
    assert percentile(xs, 90) == pytest.approx(4.6) and percentile([7.0], 99) == 7.0


def test_parse_metrics_sums_nothing_and_keeps_label_sets():
    text = '# HELP x\nx_total{a="1 2",b="}"} 3\nx_total{a="2"} 4.5 1700000000\ny 1e3\nbad line\n'
    assert parse_metrics(text) == {"x_total": [3.0, 4.5], "y": [1000.0]}


def test_labeled_samples_reads_each_label():
    text = ('# HELP r rate\nr{bucket="16",mode="plain"} 12.5\nr{bucket="1",mode="speculative"} 3\n'
            'r_other{mode="plain"} 9\n')
    assert list(labeled_samples(text, "r")) == [({"bucket": "16", "mode": "plain"}, 12.5),
                                                ({"bucket": "1", "mode": "speculative"}, 3.0)]
