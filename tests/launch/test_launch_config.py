"""Launch configs: typed TOML with one clear error per mistake, and a lossless round trip."""

import pytest

from eyas.cli import main
from eyas.errors import EyasError
from eyas.launch.launch_config import LaunchConfig, load_config

GOOD = """
backend = "sglang"
model = "/shared/kimi-k2.5-int4"
draft = "/data/eagle3/output_100k_sglang/4"
spec_steps = 2
spec_topk = 1
spec_draft_tokens = 3
tp = 8
host = "0.0.0.0"
port = 8000
python = "~/ml-env/bin/python3"
extra_args = ["--trust-remote-code", "--mem-fraction-static", "0.88"]
env = { NCCL_PROTO = "LL", NCCL_BUFFSIZE = 16777216, ODD = "a b 'q' \\"dq\\" $X \\\\ \\n2" }

[bench]
dataset = "mt-bench"
num_prompts = 80
max_tokens = 256
"""


def test_config_loads_typed_and_round_trips(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.env == {"NCCL_PROTO": "LL", "NCCL_BUFFSIZE": "16777216", "ODD": "a b 'q' \"dq\" $X \\ \n2"}
    assert (config.tp, config.spec_draft_tokens, config.bench.num_prompts, config.bench.concurrency) == (8, 3, 80, 1)
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml())
    assert load_config(again) == config
    assert LaunchConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("edit, message", [
    ('tp = 8', 'tp = "8"'),
    ('port = 8000', 'prot = 8000'),
    ('backend = "sglang"', 'backend = "trt"'),
    ('spec_draft_tokens = 3', 'spec_draft_tokens = 5'),
    ('spec_steps = 2', 'spec_steps = 0'),
    ('max_tokens = 256', 'max_token = 256'),
    ('NCCL_PROTO = "LL"', 'NCCL_PROTO = ["LL"]'),
])
def test_each_mistake_is_one_clear_error(tmp_path, edit, message):
    path = tmp_path / "s.toml"
    path.write_text(GOOD.replace(edit, message))
    with pytest.raises(EyasError) as e:
        load_config(path)
    text = str(e.value)
    assert "\n" not in text and str(path) in text
    expected = {'tp = "8"': "'tp' must be an int", "prot = 8000": "unknown key 'prot'",
                'backend = "trt"': "backend must be one of", "spec_draft_tokens = 5": "impossible with spec_topk 1",
                "spec_steps = 0": "spec_steps must be >= 1, got 0",
                "max_token = 256": "unknown key 'bench.max_token'", 'NCCL_PROTO = ["LL"]': "env.NCCL_PROTO must be"}
    assert expected[message] in text


def test_missing_file_bad_toml_and_missing_key(tmp_path, capsys):
    assert main(["launch", str(tmp_path / "nope.toml")]) == 2
    assert "no launch config at" in capsys.readouterr().err
    (tmp_path / "bad.toml").write_text("backend = ")
    assert main(["launch", str(tmp_path / "bad.toml")]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    (tmp_path / "nomodel.toml").write_text('backend = "eyas"\n')
    assert main(["launch", str(tmp_path / "nomodel.toml")]) == 2
    err = capsys.readouterr().err
    assert "model" in err and err.count("\n") == 1


def test_speculation_is_written_out_in_full():
    config = LaunchConfig(backend="eyas", model="m", draft="d", spec_steps=3, spec_topk=2)
    assert (config.spec_steps, config.spec_topk, config.spec_draft_tokens) == (3, 2, 7)  # SpecConfig's default tree
    with pytest.raises(EyasError, match="need a draft"):
        LaunchConfig(backend="eyas", model="m", spec_steps=2)
    with pytest.raises(EyasError, match="drafts a chain"):
        LaunchConfig(backend="vllm", model="m", draft="d", spec_topk=2)
