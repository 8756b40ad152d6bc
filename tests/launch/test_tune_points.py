"""The sweep grid: impossible combinations skipped with the reason, chains collapsed, env sets validated."""

import pytest

from eyas.errors import EyasError
from eyas.launch.launch_config import LaunchConfig
from eyas.ledger.tune import load_env_sets, point_config, sweep_points


def test_points_are_valid_and_distinct():
    points, skipped = sweep_points([1, 2, 3, 5], [1, 2, 4], [2, 4, 8])
    assert len(points) == len(set(points))
    chains = [p for p in points if p[1] == 1]
    assert chains == [(1, 1, 2), (2, 1, 3), (3, 1, 4), (5, 1, 6)]  # topk 1: draft tokens = steps + 1, once each
    assert (1, 2, 2) in points and (1, 4, 4) in points and (1, 2, 4) not in points
    assert any("steps 1, topk 2, draft tokens 4" in s and "impossible" in s for s in skipped)
    assert all(p[2] <= 1 + p[1] + (p[0] - 1) * p[1] ** 2 for p in points)


def test_vllm_sweeps_chains_only():
    points, skipped = sweep_points([2], [1, 2], [3], backend="vllm")
    assert points == [(2, 1, 3)] and "topk 1 only" in skipped[0]


def test_point_config_and_baseline():
    config = LaunchConfig(backend="eyas", model="m", draft="d", env={"A": "1"})
    base = point_config(config, None, {"B": "2"})
    assert base.draft is None and base.spec_steps is None and base.env == {"A": "1", "B": "2"}
    assert point_config(config, (2, 2, 5), {}).spec_draft_tokens == 5


def test_env_sets_file(tmp_path):
    path = tmp_path / "sets.toml"
    path.write_text('[plain]\n[ll]\nNCCL_PROTO = "LL"\nNCCL_BUFFSIZE = 16777216\n')
    assert load_env_sets(path) == {"plain": {}, "ll": {"NCCL_PROTO": "LL", "NCCL_BUFFSIZE": "16777216"}}
    path.write_text('NCCL_PROTO = "LL"\n')
    with pytest.raises(EyasError, match="must be a table"):
        load_env_sets(path)
