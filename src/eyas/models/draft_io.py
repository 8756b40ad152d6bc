"""EAGLE-3 draft checkpoints in and out: the EAGLE, SGLang/SpecForge and vLLM speculators layouts.

One name table converts between them: EAGLE and SGLang use our module names as they are;
speculators calls the decoder layer `layers.0` instead of `midlayer`. The embedding is never part
of a draft we save (serving reuses the target's), and is ignored when a checkpoint carries one.
A latent-attention draft exists only as SGLang/vLLM's `Eagle3DeepseekV2ForCausalLM` (config model_type
deepseek_v3, the MLA keys beside the EAGLE-3 ones); its weights load under `midlayer.*` or `layers.0.*`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.config import read_config_json
from eyas.draft_config import MLA_DRAFT_ARCHITECTURES, DraftConfig
from eyas.errors import EyasError
from eyas.models.eagle3 import Eagle3Draft
from eyas.models.tensor_file import save_tensors

LAYOUTS = ("sglang", "eagle", "speculators")
SKIPPED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def _to_ours(key: str) -> str:
    key = key[len("model."):] if key.startswith("model.") and "lm_head" not in key else key
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


def _from_ours(key: str, layout: str) -> str:
    if layout == "speculators" and key.startswith("midlayer."):
        return "layers.0." + key[len("midlayer."):]
    return key


def read_draft_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    try:
        if files:
            out = {}
            for f in files:
                out.update(load_file(str(f)))
            return out
        if (path / "pytorch_model.bin").exists():
            # weights_only: a checkpoint must never be able to run code on load.
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:
        raise EyasError(f"cannot read draft weights in {path}: {str(e).splitlines()[0]}") from None
    raise EyasError(f"no draft weights (model.safetensors or pytorch_model.bin) in {path}")


def load_draft(path: str | Path, target_config=None, dtype=torch.float32, device="cpu",
               max_positions: int | None = None) -> Eagle3Draft:
    """Load a draft in any supported layout; refuse one that does not fit the target."""
    path = Path(path)
    if not path.exists():  # not read_config_json's "model directory not found": the draft is what is missing
        raise EyasError(f"draft directory not found: {path}")
    cfg = DraftConfig.from_hf(read_config_json(path))
    if target_config is not None:
        if cfg.target_hidden_size != target_config.hidden_size:
            raise EyasError(f"draft expects target hidden size {cfg.target_hidden_size}, the target has {target_config.hidden_size}")
        if cfg.hidden_size != target_config.hidden_size:
            raise EyasError(f"draft hidden size {cfg.hidden_size} differs from the target's {target_config.hidden_size}; "
                            "the draft reads the target's embeddings, so they must agree")
        if cfg.vocab_size != target_config.vocab_size:
            raise EyasError(f"draft vocabulary ({cfg.vocab_size}) does not match the target's ({target_config.vocab_size})")
    tensors = {_to_ours(k): v for k, v in read_draft_tensors(path).items() if not k.endswith(SKIPPED)}
    if "d2t" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    draft = Eagle3Draft(cfg, max_positions)
    own = draft.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing:
        raise EyasError(f"draft checkpoint {path} is missing '{missing[0]}'")
    if unexpected:
        raise EyasError(f"draft checkpoint {path} has unexpected weight '{unexpected[0]}'")
    for k, v in tensors.items():
        if own[k].shape != v.shape:
            raise EyasError(f"draft weight {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    draft.load_state_dict({k: v if k in ("d2t", "t2d") else v.float() for k, v in tensors.items()})
    draft.d2t.copy_(tensors["d2t"].long())
    draft.t2d.copy_(tensors["t2d"].bool())
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


# The speculators release whose Eagle3DraftModel this layout is written for and tested against (tests/peers).
SPECULATORS_VERSION = "0.9.0"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_fields(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    out = dict(model_type="llama", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               num_hidden_layers=1, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
               max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
               hidden_act="silu", tie_word_embeddings=False, torch_dtype=dtype_name(dtype))
    if cfg.mla:
        # DeepseekV3Config's names, which SGLang and vLLM read; head_dim there is derived, not a key.
        del out["head_dim"]
        out.update(model_type="deepseek_v3", q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                   qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                   v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave, attention_bias=False)
    if cfg.rope_scaling:
        out["rope_scaling"] = cfg.rope_scaling
    return out


def _speculators_json(cfg: DraftConfig, dtype: torch.dtype, verifier: str | None, speculative_tokens: int | None):
    tokens = speculative_tokens or cfg.speculative_tokens
    if not tokens:
        raise EyasError("the speculators layout records how many tokens to speculate and this draft does not say; "
                        "give it (eyas draft convert --speculative-tokens N)")
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "torch_dtype": dtype_name(dtype),
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        # Every semantic flag written as the draft computes it, never left to a library's default.
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
        # speculators ids are layer inputs; ours mean "output of layer id".
        **({"eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids]} if cfg.aux_layer_ids else {}),
        "transformer_layer_config": {**_layer_fields(cfg, dtype), "architectures": ["LlamaForCausalLM"]},
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            # null: speculators then looks up no verifier on load (an empty string would be looked up).
            "verifier": {"name_or_path": verifier or None, "architectures": ["LlamaForCausalLM"]},
        },
    }


def _refuse_inexpressible(cfg: DraftConfig, layout: str) -> None:
    """SGLang's LlamaForCausalLMEagle3 and the EAGLE code read none of the speculators flags: a draft using one
    would run differently there, so it has no such layout."""
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if getattr(cfg, flag):
            raise EyasError(f"this draft uses {flag}, which the {layout} layout cannot express (SGLang and the EAGLE "
                            "code ignore it); save it with layout speculators")
    if layout != "eagle":
        return
    # The official loader (eagle/model/cnets.py) derives head_dim as hidden_size // heads and knows only the
    # `type` linear/dynamic rope scalings.
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise EyasError(f"the EAGLE code derives head_dim as hidden_size // heads ({cfg.hidden_size // cfg.num_heads}); "
                        f"this draft's is {cfg.head_dim}: save it with layout sglang or speculators")
    kind = (cfg.rope_scaling or {}).get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise EyasError(f"the EAGLE code does not implement rope scaling '{kind}': save it with layout sglang or speculators")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise EyasError("with target_hidden_size the EAGLE code takes the embedding from the draft checkpoint, and an "
                        "eyas draft carries none: save it with layout sglang or speculators")


def draft_config_json(cfg: DraftConfig, layout: str, verifier: str | None = None, dtype=torch.bfloat16,
                      speculative_tokens: int | None = None) -> dict:
    if cfg.mla and layout != "sglang":
        raise EyasError(f"a latent-attention draft has no {layout} layout (only SGLang and vLLM run "
                        f"{MLA_DRAFT_ARCHITECTURES[0]}); save it with layout sglang")
    if layout == "speculators":
        return _speculators_json(cfg, dtype, verifier, speculative_tokens)
    _refuse_inexpressible(cfg, layout)
    arch = "LlamaForCausalLMEagle3" if layout == "sglang" else "LlamaForCausalLM"
    if cfg.mla:
        arch = MLA_DRAFT_ARCHITECTURES[0]
    out = {"architectures": [arch], **_layer_fields(cfg, dtype), "draft_vocab_size": cfg.draft_vocab_size}
    if layout == "eagle" and cfg.rope_scaling:
        out["rope_scaling"] = {"type": "linear", "factor": cfg.rope_scaling["factor"]}  # the key the EAGLE code reads
    # Written only where it differs: the EAGLE code skips copying the target's embedding when the key is present.
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.aux_layer_ids:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
    return out


def save_draft(draft: Eagle3Draft, out_dir: str | Path, layout: str = "sglang", verifier: str | None = None,
               dtype=torch.bfloat16, speculative_tokens: int | None = None,
               embedding: torch.Tensor | None = None) -> Path:
    """Write config.json and the weights atomically (a crash leaves the old directory untouched): the EAGLE
    layout as pytorch_model.bin, which the official loader reads first; the others as model.safetensors.
    `speculative_tokens`: the proposal length the speculators layout records (else the draft config's).
    `embedding`: the target's token embedding, shipped as embed_tokens.weight (speculators' save_pretrained
    ships it, and its loader needs it: without one its Eagle3DraftModel keeps an uninitialised embedding)."""
    if layout not in LAYOUTS:
        raise EyasError(f"unknown draft layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    config = draft_config_json(draft.config, layout, verifier, dtype, speculative_tokens)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in draft.state_dict().items():
        v = v.detach().cpu()
        tensors[_from_ours(k, layout)] = v if k in ("d2t", "t2d") else v.to(dtype).contiguous()
    if embedding is not None:
        cfg = draft.config
        if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise EyasError(f"the target's embedding is {tuple(embedding.shape)}, the draft needs "
                            f"({cfg.vocab_size}, {cfg.hidden_size}): is it the draft's target?")
        tensors["embed_tokens.weight"] = embedding.detach().cpu().to(dtype).contiguous()
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        if layout == "eagle":
            torch.save(tensors, tmp / "pytorch_model.bin")
        else:
            save_tensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})  # as save_pretrained writes
    except EyasError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EyasError(f"could not write the draft to {out_dir}: {e.strerror or e}") from None
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    # mkdtemp makes the directory 0700 and safetensors writes 0600; a saved draft is meant to be shared.
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.replace(tmp, out_dir)
    return out_dir
