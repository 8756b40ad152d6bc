"""End to end on CPU: launch a TP=2 eyas server from a launch config with NCCL_PROTO=LL, verify every process got it,
bench, find the run with `runs best`, replay it, then launch the same server through a real shell line that
never exports the variable and check that `runs diff` names the missing worker variable first."""

import re
import socket
import sys

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.ledger.ledger import Ledger
from tests.launch.conftest import run_id_of, write_config


def eyas(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_launch_best_replay_and_diff_against_an_unexported_launch(tmp_path, capsys, tiny, prompts):
    bench = {"dataset": str(prompts), "num_prompts": 3, "max_tokens": 8}
    config = write_config(tmp_path / "good.toml", model=str(tiny), tp=2, env={"NCCL_PROTO": "LL"}, bench=bench)
    code, out, err = eyas(capsys, "launch", config)
    assert code == 0, err
    good = run_id_of(out)
    assert "environment verified in" in out
    with Ledger() as ledger:
        run = ledger.get(good)
    assert run.kind == "launch" and run.status == "ok" and run.env["NCCL_PROTO"] == "LL"
    assert run.argv[1:4] == ["-m", "eyas.cli", "serve"] and run.config["tp"] == 2
    assert len(run.workers) >= 3 and all(w.env["NCCL_PROTO"] == "LL" for w in run.workers)  # front end + 2 ranks
    assert sum("spawn_main" in w.info["cmdline"] for w in run.workers) >= 2
    assert run.results["completed"] == 3 and run.results["output_tok_s"] > 0 and run.results["env_verified"]
    assert run.versions["torch"] and run.hardware["cpu_count"] and run.results["stopped"] == "terminated"

    code, out, _ = eyas(capsys, "runs", "best", "--metric", "output_tok_s")
    assert code == 0 and out.startswith(good)

    # Generous threshold: a CPU timing on 3 prompts moves by tens of percent; the verdict logic has its own tests.
    code, out, err = eyas(capsys, "runs", "replay", good, "--threshold", "5")
    assert code == 0, out + err
    assert "PASS" in out.splitlines()[-1] and "output_tok_s" in out
    replayed = out.split("recorded as ", 1)[1].split()[0]
    with Ledger() as ledger:
        again = ledger.get(replayed)
    assert again.config["launch"]["replay_of"] == good and again.argv == run.argv and again.status == "ok"

    # The lost 94 tok/s: `NCCL_PROTO=LL; cmd` sets a shell variable that is never exported.
    line = (f"NCCL_PROTO=LL; {sys.executable} -m eyas.cli serve --model {tiny} --tp 2 --port {free_port()} "
            f"--device cpu")
    code, out, err = eyas(capsys, "launch", "--from-shell", line, "--run", "--bench-dataset", str(prompts),
                          "--bench-prompts", "3", "--bench-max-tokens", "8")
    assert code == 1, err
    assert "not exported" in out and "environment NOT verified" in out
    bad = run_id_of(out)
    with Ledger() as ledger:
        broken = ledger.get(bad)
    assert broken.status == "failed" and broken.argv == ["bash", "-c", line]
    assert broken.env["NCCL_PROTO"] == "LL"  # what the line meant to set...
    assert broken.workers and all("NCCL_PROTO" not in w.env for w in broken.workers)  # ...and what arrived

    code, out, _ = eyas(capsys, "runs", "best", "--metric", "output_tok_s")
    assert out.split()[0] in (good, replayed)  # a run whose environment did not arrive is never "best"

    code, out, _ = eyas(capsys, "runs", "diff", good, bad)
    assert code == 0
    first = out.split("most plausible explanations, in order:\n", 1)[1].splitlines()[0]
    assert re.match(r"1\. \[workers\] NCCL_PROTO: LL x\d+ -> unset x\d+ ", first) and "missing in" in first


def test_a_dying_server_shows_its_log_and_is_recorded_failed(tmp_path, capsys):
    config = write_config(tmp_path / "dead.toml", model=str(tmp_path / "no-such-model"))
    code, out, err = eyas(capsys, "launch", config)
    assert code == 2
    assert "the server exited before" in err and "no-such-model" in err  # the log tail says why
    with Ledger() as ledger:
        [run] = ledger.list()
    assert run.status == "failed" and "exited before" in run.results["error"]


def test_a_port_already_in_use_records_nothing(tmp_path, capsys, tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        config = write_config(tmp_path / "busy.toml", model=str(tiny), port=s.getsockname()[1])
        code, _, err = eyas(capsys, "launch", config)
    assert code == 2 and "already answers" in err and err.count("\n") == 1
    with Ledger() as ledger:
        assert ledger.list() == []
