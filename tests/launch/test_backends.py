"""Server command lines for SGLang and vLLM, checked against their documented flags without either installed."""

import json
import shlex

import pytest

from eyas.cli import main
from eyas.errors import EyasError
from eyas.launch.launch_backends import build_command, config_fields
from eyas.launch.launch_config import LaunchConfig

# The known-good 94 tok/s configuration, as a launch config.
KIMI = dict(model="/shared/kimi-k2.5-int4", draft="/data/eagle3/output_100k_sglang/4", spec_steps=2, spec_topk=1,
            spec_draft_tokens=3, tp=8, host="0.0.0.0", port=8000, python="/opt/ml-env/bin/python3",
            extra_args=["--trust-remote-code", "--disable-custom-all-reduce"])


def options(argv):
    """{flag: value} for `--flag value` pairs."""
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def test_sglang_command_uses_the_documented_flags():
    argv = build_command(LaunchConfig(backend="sglang", **KIMI))
    assert argv[:3] == ["/opt/ml-env/bin/python3", "-m", "sglang.launch_server"]
    documented = {
        "--model-path": "/shared/kimi-k2.5-int4", "--speculative-algorithm": "EAGLE3",
        "--speculative-draft-model-path": "/data/eagle3/output_100k_sglang/4", "--speculative-num-steps": "2",
        "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "3", "--tp-size": "8",
        "--host": "0.0.0.0", "--port": "8000"}
    assert {k: v for k, v in options(argv).items() if k in documented} == documented
    assert argv[3 + 2 * len(documented):] == ["--trust-remote-code", "--disable-custom-all-reduce"]


def test_vllm_command_uses_the_documented_flags():
    config = LaunchConfig(backend="vllm", **{**KIMI, "python": None, "spec_draft_tokens": None})
    argv = build_command(config)
    assert argv[:3] == ["vllm", "serve", "/shared/kimi-k2.5-int4"]
    opts = options(argv)
    assert json.loads(opts["--speculative-config"]) == {
        "method": "eagle3", "model": "/data/eagle3/output_100k_sglang/4", "num_speculative_tokens": 2}
    assert (opts["--tensor-parallel-size"], opts["--host"], opts["--port"]) == ("8", "0.0.0.0", "8000")
    # With an explicit interpreter the same CLI runs as a module.
    assert build_command(LaunchConfig(backend="vllm", model="m", python="/venv/bin/python"))[:4] == [
        "/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve"]


def test_no_draft_means_no_speculative_flags():
    argv = build_command(LaunchConfig(backend="sglang", model="/m", python="python3"))
    assert not [a for a in argv if "speculative" in a]


def test_extra_args_may_not_fight_the_config():
    with pytest.raises(EyasError, match="--port"):
        build_command(LaunchConfig(backend="sglang", model="/m", extra_args=["--port=9000"]))


@pytest.mark.parametrize("backend", ["eyas", "sglang", "vllm"])
def test_command_reads_back_into_the_same_config(backend):
    config = LaunchConfig(backend=backend, **{**KIMI, "spec_draft_tokens": None})
    fields = config_fields(build_command(config))
    assert LaunchConfig(**fields) == config


def test_dry_run_prints_the_exact_command_and_starts_nothing(tmp_path, capsys, home):
    path = tmp_path / "kimi.toml"
    path.write_text(LaunchConfig(backend="sglang", env={"NCCL_PROTO": "LL", "ODD": "a b"}, **KIMI).to_toml())
    assert main(["launch", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    line = out.strip().splitlines()[-1]
    words = shlex.split(line)
    assert words[:3] == ["env", "NCCL_PROTO=LL", "ODD=a b"]
    assert words[3:] == build_command(LaunchConfig(backend="sglang", **KIMI))
    assert not (home / "runs.db").exists()

    assert main(["launch", str(path), "--dry-run", "--host", "root@10.1.230.174"]) == 0
    script = capsys.readouterr().out
    # A hand launch over ssh starts from the host's login environment: so does this one, unless --clean-env.
    assert "exec env \\" in script and "  NCCL_PROTO=LL \\" in script and "  'ODD=a b' \\" in script
    assert "setsid nohup" in script
    assert main(["launch", str(path), "--dry-run", "--host", "root@10.1.230.174", "--clean-env"]) == 0
    assert "exec env -i \\" in capsys.readouterr().out


def test_eyas_launches_speculate_every_step_unless_asked_to_adapt():
    """SGLang and vLLM speculate at every step with the settings they are given; an eyas launch does the same
    (eyas serve alone would adapt), so a launch or tune point measures the configuration it names."""
    config = LaunchConfig(backend="eyas", **{**KIMI, "spec_draft_tokens": None})
    assert "--no-spec-adaptive" in build_command(config)
    adaptive = LaunchConfig(backend="eyas", **{**KIMI, "spec_draft_tokens": None, "extra_args": ["--spec-adaptive"]})
    argv = build_command(adaptive)
    assert "--no-spec-adaptive" not in argv and argv[-1] == "--spec-adaptive"
    assert LaunchConfig(**config_fields(argv)) == adaptive
