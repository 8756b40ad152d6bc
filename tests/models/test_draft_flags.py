"""Every semantic flag of a draft config is read and run (speculators/vLLM's meaning) or refused in one line."""

import json

import pytest
import torch

from eyas.draft_config import DraftConfig
from eyas.layers.kv_cache import KVCache
from eyas.errors import EyasError
from eyas.layers.attention import AttentionBatch
from eyas.models.draft_io import SPECULATORS_VERSION, load_draft, save_draft
from eyas.models.eagle3 import Eagle3Draft
from eyas.train.ttt import unroll
from tests.helpers import random_draft

H, V, T = 64, 96, 6


def flagged(seed=0, **flags) -> Eagle3Draft:
    base = random_draft(H, V, draft_vocab=40, seed=seed)
    cfg = DraftConfig(**{**base.config.to_dict(), **flags})
    draft = Eagle3Draft(cfg, max_positions=1024)
    missing, _ = draft.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for name in missing:  # the flag's own norms, away from 1 so they matter
            draft.get_parameter(name).normal_(1.0, 0.2)
    return draft.eval().requires_grad_(False)  # as load_draft returns it, so both run the same kernels


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, H, generator=g), 3 * torch.randn(1, T, 3 * H, generator=g)


def served_two_steps(draft, emb, feats):
    """Step 1 over all T positions, step 2 at T from the output at T-1 (the KV-cache path)."""
    kv = KVCache(1, 1, 16, draft.config.num_kv_heads, draft.config.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        out = draft(emb, feats, torch.arange(T)[None],
                    AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([0]), kv_len=16), fuse=True)
        nxt = draft(emb[:, -1:], out[:, -1:], torch.tensor([[T]]),
                    AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([T]), kv_len=16))
    return out, draft.logits(out), draft.logits(nxt)


def test_norm_output_feeds_the_normed_state_and_keeps_first_step_logits():
    plain, normed = flagged(), flagged(norm_output=True)
    emb, feats = inputs()
    out_p, first_p, second_p = served_two_steps(plain, emb, feats)
    out_n, first_n, second_n = served_two_steps(normed, emb, feats)
    assert torch.allclose(first_n, first_p, atol=1e-5)             # the head reads norm(h) either way
    assert torch.allclose(out_n, plain.norm(out_p), atol=1e-6)      # but the next step gets the normed state
    assert (second_n - second_p).abs().max() > 1e-2


@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
                                   {"norm_before_residual": True, "norm_output": True, "norm_before_fc": True}])
def test_flags_change_the_draft_and_ttt_agrees_with_the_served_path(flags):
    plain, draft = flagged(), flagged(**flags)
    emb, feats = inputs()
    _, first, second = served_two_steps(draft, emb, feats)
    _, first_p, second_p = served_two_steps(plain, emb, feats)
    assert (torch.cat([first, second], 1) - torch.cat([first_p, second_p], 1)).abs().max() > 1e-2
    # The TTT unroll (training) pairs feature t with token t+1: feed it the same pairs shifted by one.
    shifted = torch.cat([torch.zeros_like(emb[:, :1]), emb], 1)
    with torch.no_grad():
        outs = unroll(draft, shifted, torch.cat([feats, feats[:, -1:]], 1), 2)
    assert torch.allclose(draft.logits(outs[0])[:, :T], first, atol=1e-5)


@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True}])
def test_speculators_layout_round_trips_the_flags_and_their_weights(tmp_path, flags):
    draft = flagged(**flags)
    save_draft(draft, tmp_path / "d", layout="speculators", dtype=torch.float32, speculative_tokens=5)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert cfg[flag] is flags.get(flag, False)
    assert cfg["speculators_version"] == SPECULATORS_VERSION and cfg["torch_dtype"] == "float32"
    back = load_draft(tmp_path / "d")
    emb, feats = inputs()
    assert all(torch.equal(a, b) for a, b in zip(served_two_steps(back, emb, feats), served_two_steps(draft, emb, feats)))


@pytest.mark.parametrize("layout", ["sglang", "eagle"])
@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"])
def test_layouts_that_cannot_express_a_flag_refuse_it_by_name(tmp_path, layout, flag):
    with pytest.raises(EyasError, match=flag):
        save_draft(flagged(**{flag: True}), tmp_path / "d", layout=layout)
    assert not (tmp_path / "d").exists()


def spec_config(**over):
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": V, "rms_norm_eps": 1e-6}
    return {"speculators_model_type": "eagle3", "draft_vocab_size": 40, "transformer_layer_config": layer,
            "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}]}, **over}


def test_config_reading():
    cfg = DraftConfig.from_hf(spec_config())
    assert cfg.norm_before_residual is False  # absent: speculators' default (vLLM's reader would say True)
    assert cfg.speculative_tokens == 4 and not (cfg.norm_output or cfg.fc_norm or cfg.norm_before_fc)
    cfg = DraftConfig.from_hf(spec_config(norm_output=True, fc_norm=True, norm_before_residual=True))
    assert cfg.norm_output and cfg.fc_norm and cfg.norm_before_residual
    sglang = {**spec_config()["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": 40, "eagle_config": {"norm_before_fc": True}}
    cfg = DraftConfig.from_hf(sglang)
    assert cfg.layout == "sglang" and cfg.norm_before_fc and cfg.norm_before_residual is False


@pytest.mark.parametrize("over,match", [
    ({"norm_before_fc": True, "fc_norm": True}, "exclusive"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
])
def test_configs_eyas_would_run_differently_are_refused(over, match):
    cfg = spec_config(**over)
    if "rope_scaling" in over:
        cfg["transformer_layer_config"]["rope_scaling"] = over["rope_scaling"]
        del cfg["rope_scaling"]
    with pytest.raises(EyasError, match=match):
        DraftConfig.from_hf(cfg)


def test_speculators_export_needs_a_true_proposal_length_and_a_fitting_embedding(tmp_path):
    draft = random_draft(H, V, draft_vocab=40)
    with pytest.raises(EyasError, match="speculative-tokens"):
        save_draft(draft, tmp_path / "a", layout="speculators")
    with pytest.raises(EyasError, match="embedding"):
        save_draft(draft, tmp_path / "b", layout="speculators", speculative_tokens=3, embedding=torch.zeros(V, H + 1))
    save_draft(draft, tmp_path / "c", layout="sglang", dtype=torch.float16)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["torch_dtype"] == "float16"
