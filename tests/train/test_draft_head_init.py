"""The draft's head starts as the target's: same logits over the draft vocabulary from the same hidden state."""

import torch

from eyas.models.loader import load_model
from eyas.train.draft_init import init_head_from_target, new_draft
from eyas.train.recipe import DraftSection
from eyas.train.target import TargetHeads
from eyas.train.vocab import build_mapping


def test_head_init_reproduces_the_target_logits_on_the_draft_vocabulary(tiny_target, samples):
    target = load_model(tiny_target, "fp32", "cpu")
    mapping = build_mapping(samples, target.config.vocab_size, 64)
    draft = new_draft(target.config, DraftSection(draft_vocab_size=64), mapping)
    hidden = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        want = target.lm_head(target.model.norm(hidden))[:, mapping.used]
        assert not torch.allclose(draft.logits(hidden).float(), want, atol=1e-3)  # random head: differs
        init_head_from_target(draft, target.lm_head.weight, target.model.norm.weight)
        torch.testing.assert_close(draft.logits(hidden).float(), want, atol=1e-5, rtol=1e-5)
        # Offline training reads the same two tensors straight from the checkpoint.
        heads = TargetHeads.load(tiny_target, torch.float32, "cpu")
        other = new_draft(target.config, DraftSection(draft_vocab_size=64), mapping, seed=1)
        init_head_from_target(other, heads.lm_head_weight, heads.norm_weight)
        torch.testing.assert_close(other.logits(hidden).float(), want, atol=1e-5, rtol=1e-5)
