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
