"""`eyas launch --from-shell`: what a pasted line really sets and runs, and the launch config it is equivalent to."""

from eyas.cli import main
from eyas.launch.launch_config import load_config

# The user's known-good command exactly as pasted: its `\\`+newline continuations became `\\ `.
PASTED = ("ssh root@10.1.230.174 'NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS NCCL_MAX_NCHANNELS=16 \\ "
          "NCCL_BUFFSIZE=16777216 NCCL_NTHREADS=512 \\ EAGLE3_PROFILE=1 \\ "
          "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 "
          "\\ nohup ~/ml-env/bin/python3 -m sglang.launch_server \\ --model-path /shared/kimi-k2.5-int4 \\ "
          "--trust-remote-code \\ --tp-size 8 \\ --mem-fraction-static 0.88 \\ --host 0.0.0.0 \\ --port 8000 \\ "
          "--num-continuous-decode-steps 4 \\ --disable-custom-all-reduce \\ --speculative-algorithm EAGLE3 \\ "
          "--speculative-draft-model-path /data/eagle3/output_100k_sglang/4 \\ --speculative-eagle-topk 1 \\ "
          "--speculative-num-draft-tokens 3 \\ --speculative-num-steps 2 \\ "
          "> /data/eagle3/synth_100k/logs/sglang_eagle3_nccl_2step.log 2>&1 &' "
          "echo \"EAGLE3 2-step + NCCL starting...\"")


def test_pasted_line_is_explained_and_written_as_the_config_it_meant(tmp_path, capsys):
    out_path = tmp_path / "kimi.toml"
    assert main(["launch", "--from-shell", PASTED, "--write", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "as pasted, the line starts no server" in out and "NCCL_BUFFSIZE" in out
    assert "eyas launch CONFIG.toml --host root@10.1.230.174" in out
    config = load_config(out_path)
    assert config.backend == "sglang" and config.python == "~/ml-env/bin/python3"
    assert (config.model, config.tp, config.port, config.host) == ("/shared/kimi-k2.5-int4", 8, 8000, "0.0.0.0")
    assert (config.draft, config.spec_steps, config.spec_topk, config.spec_draft_tokens) == (
        "/data/eagle3/output_100k_sglang/4", 2, 1, 3)
    assert config.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
                        "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512", "EAGLE3_PROFILE": "1",
                        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    assert config.extra_args == ["--trust-remote-code", "--mem-fraction-static", "0.88",
                               "--num-continuous-decode-steps", "4", "--disable-custom-all-reduce"]


def test_unexported_variable_is_not_in_the_real_config(tmp_path, capsys):
    line = "NCCL_PROTO=LL; NCCL_ALGO=Ring python3 -m sglang.launch_server --model-path /m --tp 2"
    assert main(["launch", "--from-shell", line]) == 0
    out = capsys.readouterr().out
    assert "not exported" in out and "the server does not get: NCCL_PROTO=LL" in out
    real = out.split("equivalent launch config:\n", 1)[1]
    assert 'NCCL_ALGO = "Ring"' in real and "NCCL_PROTO" not in real and "tp = 2" in real
    assert main(["launch", "--from-shell", line, "--as-intended", "--write", str(tmp_path / "s.toml")]) == 0
    assert load_config(tmp_path / "s.toml").env == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}


def test_lines_that_start_no_known_server_are_one_line_errors(capsys):
    assert main(["launch", "--from-shell", "echo hi && sleep 1"]) == 2
    assert "not a server command" in capsys.readouterr().err
    assert main(["launch", "--from-shell", "python -m sglang.launch_server --model-path /m --tp-size"]) == 2
    assert "--tp-size has no value" in capsys.readouterr().err
    assert main(["launch", "--from-shell", "X=1 \\ python -m sglang.launch_server --model-path /m", "--run",
                 "--host", "h"]) == 2
    assert "--run runs the line on this machine" in capsys.readouterr().err
