"""Sparse MoE targets equal HF transformers (fp32, 1e-4); the grouped expert path equals the reference loop;
expert weights shard across TP ranks like a dense MLP; routing follows each family's rule."""

import pytest
import torch

from eyas.config import ModelConfig
from eyas.tensor_parallel import TPContext
from eyas.models.loader import load_model, load_weights
from eyas.models.llama import CausalLM
from eyas.models.moe import GROUPED_MM, Experts, Router
from tests.models.tiny_moe import assert_matches_hf, build_hf, save_tiny

needs_grouped_mm = pytest.mark.skipif(GROUPED_MM is None, reason="this torch has no grouped matmul")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_logits_match_hf_prefill_and_appends(name, tmp_path):
    hf = save_tiny(name, tmp_path)
    ours = load_model(tmp_path, "fp32", "cpu")
    assert ours.config.num_experts == 8 and ours.config.scoring == "softmax"
    if name == "qwen3_moe":
        assert ours.config.moe_layers == [0, 2, 3]  # mlp_only_layers=[1] stays dense
    assert_matches_hf(ours, hf)


@needs_grouped_mm
def test_grouped_experts_in_the_model_match_hf(tmp_path):
    """The whole model with every MoE layer on the grouped path (the one CUDA uses) still equals HF."""
    hf = save_tiny("mixtral", tmp_path)
    ours = load_model(tmp_path, "fp32", "cpu")
    for m in ours.modules():
        if isinstance(m, Experts):
            m.grouped = True
    assert_matches_hf(ours, hf)


def test_stacked_expert_layout_loads(tmp_path):
    """transformers 5 holds experts stacked in memory (experts.gate_up_proj [E, 2I, H]); that layout loads too."""
    hf = save_tiny("qwen3_moe", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    ours = CausalLM(cfg).float()
    load_weights(ours, hf.state_dict().items())
    assert_matches_hf(ours.eval(), hf)


def test_bf16_load_never_materializes_fp32(tmp_path, monkeypatch):
    """Weights are allocated in the load dtype from the start: a 30B-parameter MoE materialized in fp32 first would
    need 122 GB on the device before its cast to 61 GB of bf16. Only the routers are fp32 (models/moe.py)."""
    save_tiny("qwen3_moe", tmp_path)
    seen = {}
    to_empty = torch.nn.Module.to_empty

    def spy(self, *args, **kwargs):
        seen.update({n: p.dtype for n, p in self.named_parameters()})
        return to_empty(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model = load_model(tmp_path, "bf16", "cpu")
    assert {n for n, d in seen.items() if d != torch.bfloat16} == {f"model.layers.{i}.mlp.gate.weight" for i in (0, 2, 3)}
    assert {n: p.dtype for n, p in model.named_parameters()} == seen
    assert model.model.rotary.cos.dtype == torch.float32


def _random_experts(E=8, H=64, inter=32, tp=TPContext(), seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g) / 8, torch.randn(E, H, inter, generator=g) / 6
    ex = Experts(E, H, inter, tp)
    ex.load("gate_up_proj", gate_up)
    ex.load("down_proj", down)
    return ex


@needs_grouped_mm
def test_grouped_equals_reference_with_idle_experts():
    ex = _random_experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g)
    ids = torch.randint(0, 5, (37, 3), generator=g)  # experts 5..7 get no tokens
    ids[:, 1] = (ids[:, 0] + 1) % 5                   # distinct experts per token, as top-k gives
    ids[:, 2] = (ids[:, 0] + 2) % 5
    w = torch.rand(37, 3, generator=g)
    ref, grouped = ex.forward_reference(x, w, ids), ex.forward_grouped(x, w, ids)
    assert torch.allclose(ref, grouped, atol=1e-5, rtol=0), (ref - grouped).abs().max()


def test_expert_shards_sum_to_the_whole():
    """Each rank holds a slice of every expert's intermediate dim; the ranks' partial outputs sum to TP=1's."""
    whole = _random_experts()
    x = torch.randn(9, 64)
    w, ids = torch.rand(9, 2), torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    parts = [_random_experts(tp=TPContext(rank=r, size=2)) for r in (0, 1)]
    assert parts[0].gate_up_proj.shape == (8, 32, 64) and parts[0].down_proj.shape == (8, 64, 16)
    total = sum(p.forward_reference(x, w, ids) for p in parts)
    assert torch.allclose(total, whole.forward_reference(x, w, ids), atol=1e-5)
    # Per-expert checkpoint tensors land in the same places as the stacked ones.
    one = Experts(8, 64, 32, TPContext(rank=1, size=2))
    for e in range(8):
        gate, up = whole.gate_up_proj[e].chunk(2)
        one.load("gate_up_proj", gate, (e, 0))
        one.load("gate_up_proj", up, (e, 1))
        one.load("down_proj", whole.down_proj[e], e)
    assert torch.equal(one.gate_up_proj, parts[1].gate_up_proj) and torch.equal(one.down_proj, parts[1].down_proj)


def test_grouped_routing_stays_inside_the_best_groups():
    """DeepSeek routing: groups ranked by their two best biased scores; weights are unbiased scores * scale."""
    hf = build_hf("deepseek_v3")
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]})
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(hf.model.layers[1].mlp.gate.weight)
        router.e_score_correction_bias.copy_(hf.model.layers[1].mlp.gate.e_score_correction_bias)
    x = torch.randn(50, 64)
    weights, ids = router(x)
    _, want_w, want_ids = hf.model.layers[1].mlp.gate(x)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    assert torch.allclose(weights.gather(1, order.indices), want_w.gather(1, want_order.indices), atol=1e-6)
    groups = ids // (cfg.num_experts // cfg.n_group)
    assert all(len(set(row.tolist())) <= cfg.topk_group for row in groups)
    assert torch.allclose(weights.sum(-1), torch.full((50,), 2.5), atol=1e-5)  # renormalized, then scaled
