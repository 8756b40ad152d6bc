"""The official EAGLE loader's rules, which eyas's EAGLE layout must satisfy (its code is not on PyPI, so they are
encoded here). Each rule cites SafeAILab/EAGLE at commit cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b:

R1 eagle/model/ea_model.py:124-135: `EaModel.from_pretrained` loads `pytorch_model.bin` with torch.load and falls
   back to `model.safetensors` only when that fails.
R2 eagle/model/cnets.py:488: the target's embedding is copied into the draft only
   `if load_emb and not hasattr(config, "target_hidden_size")`; nothing sets it later, so a config with
   target_hidden_size must ship `embed_tokens.weight` or the draft runs with a random embedding.
R3 eagle/model/cnets.py:531-534: fc is Linear(3 * (target_hidden_size if present else hidden_size), hidden_size).
R4 eagle/model/ea_model.py:76: `load_state_dict(..., strict=False)`: a key the module does not have is ignored and a
   missing one stays random, so the keys must be exactly the module's (`midlayer.*`, not speculators' `layers.0.*`).
R5 eagle/model/ea_model.py:74: with vocab_size == draft_vocab_size the module drops d2t and t2d.
R6 eagle/model/cnets.py:199: head_dim is hidden_size // num_attention_heads; a `head_dim` key is not read.
R7 eagle/model/cnets.py:215-236: rope_scaling is read as `rope_scaling["type"]` and `["factor"]`, linear or dynamic
   only; rope_theta is read where present (else base 10000).
R8 eagle/traineagle3/config.json: the draft config is a Llama config, architectures ["LlamaForCausalLM"],
   model_type llama, num_hidden_layers 1, with vocab_size and draft_vocab_size.
"""

import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.models.draft_io import save_draft
from tests.helpers import random_draft

H, V = 64, 96


def official_module_keys(cfg: dict) -> dict[str, tuple]:
    """The state-dict keys and shapes of the official EAGLE-3 `Model` built from `cfg` (R3, R5, R6)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads                                                           # R6
    fc_in = 3 * cfg.get("target_hidden_size", h)                             # R3
    keys = {"embed_tokens.weight": (cfg["vocab_size"], h), "fc.weight": (h, fc_in), "norm.weight": (h,),
            "lm_head.weight": (cfg["draft_vocab_size"], h),
            "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": (h, heads * d),
            "midlayer.mlp.gate_proj.weight": (cfg["intermediate_size"], h),
            "midlayer.mlp.up_proj.weight": (cfg["intermediate_size"], h),
            "midlayer.mlp.down_proj.weight": (h, cfg["intermediate_size"]),
            "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,)}
    if cfg["vocab_size"] != cfg["draft_vocab_size"]:                          # R5
        keys.update(d2t=(cfg["draft_vocab_size"],), t2d=(cfg["vocab_size"],))
    return keys


def official_load(path) -> tuple[dict, dict, str]:
    """What the official loader would do with a draft directory: its config, the state dict it reads (R1) and
    where its embedding comes from (R2)."""
    cfg = json.loads((path / "config.json").read_text())
    state = torch.load(path / "pytorch_model.bin", map_location="cpu")       # R1: tried first
    if "target_hidden_size" not in cfg:                                       # R2
        source = "target"
    else:
        source = "checkpoint" if "embed_tokens.weight" in state else "random"
    return cfg, state, source


def test_eagle_layout_loads_exactly_into_the_official_module(tmp_path):
    draft = random_draft(H, V, draft_vocab=40)
    save_draft(draft, tmp_path / "d", layout="eagle", dtype=torch.float16)
    cfg, state, source = official_load(tmp_path / "d")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"     # R8
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == V
    assert cfg["torch_dtype"] == "float16" and state["fc.weight"].dtype == torch.float16
    assert source == "target"                                                                # R2
    expected = official_module_keys(cfg)
    expected.pop("embed_tokens.weight")  # the frozen embedding comes from the target (R2)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected                         # R4: strict in effect
    for k, v in draft.state_dict().items():
        assert torch.equal(state[k], v if k in ("d2t", "t2d") else v.half())


def test_loader_rules_catch_what_broke_before(tmp_path):
    """The rules fail the export eyas wrote before (target_hidden_size equal to hidden_size, no embedding) and a
    speculators-named checkpoint, so the test above can fail."""
    draft = random_draft(H, V, draft_vocab=40)
    save_draft(draft, tmp_path / "d", layout="eagle", dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": H}))
    assert official_load(tmp_path / "d")[2] == "random"
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in draft.state_dict().items()}
    assert set(state) != set(official_module_keys(cfg)) - {"embed_tokens.weight"}


def test_same_vocab_draft_drops_the_mapping_as_the_official_module_does(tmp_path):
    save_draft(random_draft(H, V), tmp_path / "d", layout="eagle", dtype=torch.float32)
    cfg, state, _ = official_load(tmp_path / "d")
    expected = official_module_keys(cfg)
    assert "d2t" not in expected                                                             # R5
    # eyas writes its identity mapping anyway; R4 (strict=False) ignores the extra buffers, and they equal the
    # offsets the official module would use (none).
    assert set(state) - set(expected) == {"d2t", "t2d"} and not state["d2t"].any()


def test_what_the_official_code_cannot_express_is_refused(tmp_path):
    odd_head = random_draft(H, V, head_dim=32)                                               # R6
    with pytest.raises(EyasError, match="head_dim"):
        save_draft(odd_head, tmp_path / "a", layout="eagle")
    scaled = random_draft(H, V)
    scaled.config.rope_scaling = {"rope_type": "yarn", "factor": 2.0}                         # R7
    with pytest.raises(EyasError, match="yarn"):
        save_draft(scaled, tmp_path / "b", layout="eagle")
    linear = random_draft(H, V)
    linear.config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    save_draft(linear, tmp_path / "c", layout="eagle")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["rope_scaling"] == {"type": "linear", "factor": 2.0}
    wide = random_draft(H, V)
    wide.config.target_hidden_size = 2 * H                                                   # R2 with R3
    with pytest.raises(EyasError, match="embedding"):
        save_draft(wide, tmp_path / "e", layout="eagle")
    assert not any(p.name.startswith(("a", "b", "e")) for p in tmp_path.iterdir())  # nothing half-written
