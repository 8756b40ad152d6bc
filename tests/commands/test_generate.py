"""`eyas generate` on the demo model equals HF transformers' greedy generate; bad input gives one line and exit 2."""

import json
import shutil

import pytest
import torch
import transformers

from eyas.cli import main
from tests.helpers import tiny_llama

PROMPTS = ["Name three birds of prey.", "What is 17 times 23?"]  # 64 tokens each, the HF side eager on the CPU


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def hf_demo(demo_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    return model, tok


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_demo_matches_hf_greedy(capsys, hf_demo, prompt):
    code, out, _ = run_cli(capsys, "generate", "--model", "demo", "--chat", "--temperature", "0", "--max-tokens", "64",
                           "--prompt", prompt, "--json", "--device", "cpu")
    assert code == 0
    ours = json.loads(out)
    model, tok = hf_demo
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours["num_prompt_tokens"] == ids.shape[1]
    assert ours["token_ids"] == hf
    assert set(ours) >= {"text", "token_ids", "num_prompt_tokens", "num_tokens", "seconds", "tokens_per_second"}
    assert ours["execution_plan"]["device"] == "cpu" and not ours["execution_plan"]["kernels"]


def _bad_dirs(tmp_path):
    tiny = tmp_path / "tiny"
    tiny_llama(tiny)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny / "config.json", no_weights / "config.json")
    bad_arch = tmp_path / "bad_arch"
    shutil.copytree(tiny, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny, corrupt)
    f = corrupt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return {"missing directory": (tmp_path / "nope", "not found"), "no weights": (no_weights, "no *.safetensors"),
            "unsupported architecture": (bad_arch, "unsupported architecture"), "corrupted": (corrupt, "corrupted")}


def test_bad_model_inputs_give_one_line_and_exit_2(capsys, tmp_path):
    cases = _bad_dirs(tmp_path)
    capsys.readouterr()  # drop the checkpoint writer's progress output
    for what, (path, needle) in cases.items():
        code, out, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2",
                                 "--device", "cpu")
        assert code == 2, what
        assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, (what, err)
