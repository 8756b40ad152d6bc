"""SGLang's speculative knobs: validation and auto-adjustment."""

import pytest

from eyas.config import SpecConfig
from eyas.errors import EyasError


def test_topk_one_forces_steps_plus_one():
    assert SpecConfig(3, 1, 8).draft_tokens == 4
    assert SpecConfig(5, 1).draft_tokens == 6


def test_tree_bounds():
    assert SpecConfig(5, 4, 8).draft_tokens == 8
    assert SpecConfig(2, 2).draft_tokens == 5
    assert SpecConfig(2, 2, 7).draft_tokens == 7          # 1 + 2 + 1*4 = 7 is the most
    with pytest.raises(EyasError, match="between 2 and 7"):
        SpecConfig(2, 2, 8)
    with pytest.raises(EyasError, match="impossible"):
        SpecConfig(3, 4, 1)


@pytest.mark.parametrize("steps,topk", [(0, 1), (3, 0), (-1, 2)])
def test_nonpositive_refused(steps, topk):
    with pytest.raises(EyasError):
        SpecConfig(steps, topk)


def test_a_draft_for_a_deeper_target_is_refused_in_one_line(tmp_path):
    """A draft reads the target's hidden states at three layers; a target that lacks one of them is named in a
    clear error at start, not a KeyError in the first forward."""
    from eyas.engine.engine import Engine
    from tests.helpers import random_draft, tiny_llama

    tiny_llama(tmp_path, vocab=32, layers=3, hidden=64)
    draft = random_draft(64, 32)
    draft.config.aux_layer_ids = [1, 40, 77]  # a draft trained on an 80-layer target
    with pytest.raises(EyasError, match=r"aux_layer_ids \[1, 40, 77\].* 3 layers") as e:
        Engine(str(tmp_path), dtype="fp32", max_batch=1, max_len=64, draft=draft, spec=SpecConfig(3, 1))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layers,ok", [(2, False), (3, True)])
def test_the_default_layers_need_a_target_of_three_layers(layers, ok):
    from eyas.draft_config import DraftConfig

    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=32,
                      draft_vocab_size=32, target_hidden_size=64)
    if ok:
        assert cfg.capture_layers(layers) == (2, 1, 0)
    else:
        with pytest.raises(EyasError, match="layers 2, L//2 and L-3"):
            cfg.capture_layers(layers)
