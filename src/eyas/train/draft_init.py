"""A new draft shaped for its target: sizes from the target's config, the vocabulary from the data.

Usage: draft = new_draft(target_config, recipe.draft, mapping, seed=0)

The draft's hidden size must equal the target's (it reads the target's token embeddings); heads,
key/value heads, head_dim and the MLP width default to the target's as SpecForge does; RoPE uses
theta 10000 unless the recipe says otherwise (EAGLE-3's released drafts do).
"""

from __future__ import annotations

import torch

from eyas.config import ModelConfig
from eyas.draft_config import DraftConfig
from eyas.errors import EyasError
from eyas.models.draft_io import load_draft
from eyas.models.eagle3 import Eagle3Draft
from eyas.train.vocab import VocabMapping


def draft_config_for(target: ModelConfig, section) -> DraftConfig:
    L = target.num_layers
    if section.aux_layer_ids:
        # SGLang meaning: "output of layer i", captured as the input of layer i + 1, which must exist.
        bad = [i for i in section.aux_layer_ids if not 0 <= i < L - 1]
        if bad:
            raise EyasError(f"[draft] aux_layer_ids {section.aux_layer_ids} do not fit a target with {L} layers "
                            f"(each must be in 0..{L - 2})")
    elif L < 4:
        raise EyasError(f"the target has {L} layers; EAGLE-3's default feature layers need at least 4")
    if section.draft_vocab_size > target.vocab_size:
        raise EyasError(f"[draft] draft_vocab_size {section.draft_vocab_size} exceeds the target's vocabulary "
                        f"({target.vocab_size})")
    heads, kv_heads, head_dim = target.num_heads, target.num_kv_heads, target.head_dim
    if getattr(target, "mla", False):
        # An MLA target's head_dim is only its rope part; the draft is a plain Llama layer, so give it
        # ordinary 128-wide heads over the same hidden size.
        head_dim = 128
        heads = kv_heads = max(1, target.hidden_size // head_dim)
    return DraftConfig(
        hidden_size=target.hidden_size,
        intermediate_size=section.intermediate_size or target.intermediate_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=target.vocab_size,
        draft_vocab_size=section.draft_vocab_size,
        target_hidden_size=target.hidden_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=section.rope_theta,
        max_position_embeddings=target.max_position_embeddings,
        aux_layer_ids=list(section.aux_layer_ids) or None,
    )


@torch.no_grad()
def init_head_from_target(draft: Eagle3Draft, lm_head: torch.Tensor, final_norm: torch.Tensor | None):
    """Start the draft's output where the target's is: the target's LM-head rows of the draft vocabulary
    and its final norm, so that training starts from a head that already reads the target's hidden
    states. Not the default: on the demo target it ended lower than a random head (held-out acceptance
    1.95 vs 2.03 after 3,000 steps, docs/training.md)."""
    rows = torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device) + draft.d2t.long()
    if int(rows.max()) >= lm_head.shape[0] or lm_head.shape[1] != draft.config.hidden_size:
        raise EyasError(f"the target's LM head {tuple(lm_head.shape)} does not fit the draft "
                        f"(hidden {draft.config.hidden_size}, vocabulary {draft.config.vocab_size})")
    draft.lm_head.weight.copy_(lm_head.to(rows.device)[rows].to(draft.lm_head.weight.dtype))
    if final_norm is not None:
        draft.norm.weight.copy_(final_norm.to(draft.norm.weight))


def new_draft(target: ModelConfig, section, mapping: VocabMapping, seed: int = 0) -> Eagle3Draft:
    """Random weights (torch's default init, norms at 1), or `section.init_from`'s, with the data's vocabulary.
    The pipeline then copies the target's head in when `section.head_init` is "target" (init_head_from_target)."""
    if section.init_from:
        draft = load_draft(section.init_from, target).float().requires_grad_(True).train()
        if draft.config.draft_vocab_size != mapping.d2t.numel():
            raise EyasError(f"{section.init_from} has draft_vocab_size {draft.config.draft_vocab_size}, the recipe "
                            f"{mapping.d2t.numel()}")
        return draft
    cfg = draft_config_for(target, section)
    if mapping.d2t.numel() != cfg.draft_vocab_size or mapping.t2d.numel() != cfg.vocab_size:
        raise EyasError(f"the vocabulary mapping ({mapping.d2t.numel()} of {mapping.t2d.numel()} tokens) does not "
                        f"match the draft ({cfg.draft_vocab_size} of {cfg.vocab_size}); run `eyas train vocab` again")
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.d2t.copy_(mapping.d2t)
        draft.t2d.copy_(mapping.t2d)
    return draft.train()
