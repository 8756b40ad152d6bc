"""`eyas draft convert` and `eyas draft check`, and the check `eyas launch` runs before it starts a server."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.cli import main
from eyas.commands.draft import check_before_launch
from eyas.errors import EyasError
from eyas.models.draft_io import load_draft, read_draft_tensors, save_draft
from tests.helpers import random_draft

H, V, LAYERS = 64, 96, 7
ASSET_DRAFT = Path(__file__).resolve().parents[2] / "assets" / "smollm2-135m-eagle3"


def target_dir(tmp_path, hidden=H, vocab=V, layers=LAYERS):
    d = tmp_path / f"target-{hidden}-{vocab}-{layers}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": vocab}))
    return d


def draft_dir(tmp_path, name="d", aux=None, layout="sglang", **kw):
    draft = random_draft(H, V, draft_vocab=40)
    draft.config.aux_layer_ids = aux
    save_draft(draft, tmp_path / name, layout=layout, dtype=torch.float32, **kw)
    return tmp_path / name, draft


def test_convert_round_trip_through_every_layout_keeps_the_weights(tmp_path):
    src, draft = draft_dir(tmp_path, aux=[1, 2, 3])
    chain = [("eagle", src), ("speculators", tmp_path / "eagle"), ("sglang", tmp_path / "speculators")]
    for layout, prev in chain:
        extra = ["--speculative-tokens", "2"] if layout == "speculators" else []
        assert main(["draft", "convert", str(prev), str(tmp_path / layout), "--layout", layout, *extra]) == 0
        assert load_draft(tmp_path / layout).config.layout == layout
    ours = {k: v for k, v in read_draft_tensors(tmp_path / "sglang").items()}
    assert ours.keys() == draft.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in draft.state_dict().items())
    assert json.loads((tmp_path / "sglang" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert load_draft(tmp_path / "sglang").config.capture_layers(LAYERS) == (2, 3, 4)


def test_convert_to_speculators_with_target_ships_embedding_and_verifier(tmp_path):
    from safetensors.torch import save_file

    tgt = target_dir(tmp_path)
    embed = torch.randn(V, H)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": torch.randn(V, H)}, str(tgt / "model.safetensors"))
    src, _ = draft_dir(tmp_path)
    assert main(["draft", "convert", str(src), str(tmp_path / "s"), "--layout", "speculators", "--target", str(tgt),
                 "--speculative-tokens", "3", "--dtype", "bf16"]) == 0
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tgt.resolve())
    assert cfg["torch_dtype"] == "bfloat16"
    assert torch.equal(read_draft_tensors(tmp_path / "s")["embed_tokens.weight"], embed.bfloat16())


def test_convert_refuses_bad_input_in_one_line(tmp_path, capsys):
    src, _ = draft_dir(tmp_path)
    assert main(["draft", "convert", str(src), str(src), "--layout", "eagle"]) == 2
    assert main(["draft", "convert", str(src), str(tmp_path / "x"), "--layout", "speculators"]) == 2
    assert main(["draft", "convert", str(tmp_path / "nope"), str(tmp_path / "y"), "--layout", "eagle"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("eyas: error:") for line in err)
    assert "--speculative-tokens" in err[1] and "not found" in err[2]


def check(args, capsys):
    rc = main(["draft", "check", *map(str, args)])
    return rc, capsys.readouterr().out


def test_check_a_sound_draft(tmp_path, capsys):
    src, _ = draft_dir(tmp_path)
    rc, out = check([src, "--target", target_dir(tmp_path)], capsys)
    assert rc == 0 and "sglang layout" in out and "no problems found" in out
    for flag in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm"):
        assert f"{flag} = false" in out
    assert "hot_token_id" in out and "layers.0" in out and "sglang: [2, 3, 4]" in out


def test_check_names_the_sglang_eagle_eagle3_mismatch(tmp_path, capsys):
    src, _ = draft_dir(tmp_path)
    rc, out = check([src, "--sglang-algorithm", "EAGLE"], capsys)
    assert rc == 1 and "PROBLEM (sglang)" in out and "acceptance exactly 1.0" in out
    assert check([src, "--sglang-algorithm", "EAGLE3"], capsys)[0] == 0


def test_check_names_a_capture_layer_the_target_lacks(tmp_path, capsys):
    src, _ = draft_dir(tmp_path, aux=[1, 3, 20])
    rc, out = check([src, "--target", target_dir(tmp_path)], capsys)
    assert rc == 1 and "input of layer 21" in out and f"{LAYERS} layers" in out


def test_check_names_explicit_ids_vllm_reads_off_by_one(tmp_path, capsys):
    src, _ = draft_dir(tmp_path, aux=[1, 2, 3])
    rc, out = check([src, "--target", target_dir(tmp_path)], capsys)
    assert rc == 1 and "PROBLEM (vllm): vllm feeds layers [1, 2, 3], the draft reads [2, 3, 4]" in out


def test_check_names_hidden_size_vocabulary_and_mapping_problems(tmp_path, capsys):
    src, _ = draft_dir(tmp_path)
    rc, out = check([src, "--target", target_dir(tmp_path, hidden=128)], capsys)
    assert rc == 1 and "target hidden size 64" in out
    rc, out = check([src, "--target", target_dir(tmp_path, vocab=128)], capsys)
    assert rc == 1 and "vocabulary 96 differs" in out
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    del weights["d2t"]
    save_file(weights, str(src / "model.safetensors"))
    rc, out = check([src], capsys)
    assert rc == 1 and "no d2t vocabulary mapping" in out


def test_check_speculators_layout_problems(tmp_path, capsys):
    src, _ = draft_dir(tmp_path, layout="speculators", speculative_tokens=3)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["norm_before_residual"]
    (src / "config.json").write_text(json.dumps(cfg))
    rc, out = check([src], capsys)
    assert rc == 1 and "norm_before_residual = false (absent, so speculators' default)" in out
    assert "vLLM's speculators reader as true" in out and "uninitialised embedding" in out
    assert "verifier.name_or_path" in out


def test_check_reports_a_config_eyas_refuses(tmp_path, capsys):
    src, _ = draft_dir(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    rc, out = check([src], capsys)
    assert rc == 1 and "eyas refuses" in out and "dynamic" in out


def test_check_flags_the_official_embedding_trap(tmp_path, capsys):
    src, _ = draft_dir(tmp_path, layout="eagle")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": H}))
    rc, out = check([src], capsys)
    assert rc == 1 and "PROBLEM (eagle)" in out and "random embedding" in out


def test_launch_check_stops_a_draft_the_backend_would_run_wrongly(tmp_path):
    tgt = target_dir(tmp_path)
    bad, _ = draft_dir(tmp_path, "bad", aux=[1, 3, 20])
    with pytest.raises(EyasError, match="layer 21"):
        check_before_launch(str(bad), str(tgt), "sglang")
    ids, _ = draft_dir(tmp_path, "ids", aux=[1, 2, 3])
    check_before_launch(str(ids), str(tgt), "sglang")  # SGLang reads the ids as the draft means them
    with pytest.raises(EyasError, match="vllm feeds layers"):
        check_before_launch(str(ids), str(tgt), "vllm")
    check_before_launch(str(tmp_path / "remote-only"), str(tgt), "vllm")  # not on this machine: left to the server


def test_any_verb_piped_into_head_ends_without_a_traceback():
    script = "import sys; from eyas.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(["bash", "-c", f"{sys.executable} -c '{script}' draft check {ASSET_DRAFT} | head -1"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.count("\n") == 1 and done.stderr == ""
