"""bench_serve_load's report: each server is compared with the plain server of its own round."""

from benchmarks.bench_serve_load import slower_than_plain, spread, table


def row(rnd, server, concurrency, tok_s):
    return {"round": rnd, "server": server, "concurrency": concurrency, "output_tok_s": tok_s, "completed": 4,
            "errors": 0, "request_s": 1.0, "ttft_ms": None, "itl_ms": None, "accept_length": None, "spec_steps": {}}


def test_rounds_are_compared_within_themselves():
    """Round 2's plain server ran slower than round 1's: adaptive is slower than plain in round 1 only,
    although its round-2 rate is below round 1's plain rate."""
    rows = [row(1, "plain", 16, 100.0), row(1, "adaptive", 16, 99.0),
            row(2, "plain", 16, 90.0), row(2, "adaptive", 16, 95.0)]
    assert slower_than_plain(rows) == ["adaptive at concurrency 16 in round 1 (0.99x)"]
    assert spread(rows) == ["adaptive at 16: 0.99x-1.06x over 2 rounds"]
    lines = table(rows).splitlines()
    assert lines[3].startswith("| 1 | adaptive | 16 |") and lines[3].endswith("| 0.99x |")
    assert lines[5].startswith("| 2 | adaptive | 16 |") and lines[5].endswith("| 1.06x |")


def test_one_round_has_no_spread():
    assert spread([row(1, "plain", 1, 10.0), row(1, "spec", 1, 12.0)]) == []


def test_engine_time_reads_steps_and_joins_from_the_servers_metrics():
    """Every server exports its step times, and apart those of the steps that prefilled joining requests;
    the benchmark reads them per level to show where the engine's time went in each server."""
    from benchmarks.bench_serve_load import engine_line, engine_time
    from eyas.dist.messages import StepResult
    from eyas.server.metrics import Metrics

    m = Metrics()
    empty = engine_time(m.render().decode())
    assert empty == dict.fromkeys(("steps", "step_s", "join_steps", "join_s", "joined"), 0.0)
    for step_ms, joined in ((2.0, 0), (30.0, 2), (4.0, 0), (20.0, 1)):
        m.step(StepResult([], running=1, waiting=0, kv_usage=0.5, step_ms=step_ms, joined=joined))
    e = engine_time(m.render().decode())
    assert e["steps"] == 4 and e["join_steps"] == 2 and e["joined"] == 3
    assert abs(e["step_s"] - 0.056) < 1e-9 and abs(e["join_s"] - 0.05) < 1e-9
    line = engine_line(e, 1.0)
    assert "0.06 s of the level's 1.00 s" in line and "2 steps without joins (3.00 ms each)" in line
    assert "2 with joins (25.00 ms each, 3 requests)" in line


def test_the_front_end_cpu_is_read_from_proc_and_printed():
    """A process's CPU seconds come from /proc (this process, which has used some); the level's line says
    how much CPU the server's own process used, when it is known."""
    import os
    import time

    from benchmarks.bench_serve_load import engine_line, engine_time, process_cpu_s
    from eyas.server.metrics import Metrics

    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:  # burn 50 ms of CPU
        pass
    after = process_cpu_s(os.getpid())
    assert before is not None and after - before >= 0.03
    assert process_cpu_s(2 ** 22 + 12345) is None  # no such process
    e = engine_time(Metrics().render().decode())
    assert engine_line(e, 2.0, 1.5).endswith("; the front end used 1.50 s of CPU")
    assert "front end" not in engine_line(e, 2.0)
