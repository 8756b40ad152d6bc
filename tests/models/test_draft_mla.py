"""EAGLE-3 drafts with DeepSeek's latent attention (SGLang/vLLM `Eagle3DeepseekV2ForCausalLM`): the layer computes
the upstream (non-absorbed) math, checkpoints round-trip and load under the upstream names, training-time test
equals the cached inference chain, speculative greedy equals plain greedy on a DeepSeek-V3 target, misfits are refused."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from eyas.config import ModelConfig, SpecConfig
from eyas.draft_config import DraftConfig
from eyas.engine.engine import Engine
from eyas.layers.kv_cache import KVCache
from eyas.engine.profile import Profiler
from eyas.errors import EyasError
from eyas.layers.attention import AttentionBatch
from eyas.layers.sampling import SamplingParams
from eyas.models.draft_io import load_draft, save_draft
from eyas.models.eagle3 import Eagle3Draft
from eyas.train.ttt import TTTModel, teacher_from_logits, unroll
from tests.models.tiny_moe import save_tiny
from tests.train.test_ttt import _inference_chain

H, V, VD = 64, 96, 40
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
# DeepSeek-V3's shape (low-rank q, interleaved rope pairs) and V2-Lite's (full-rank q, rotate-half).
VARIANTS = {"low-rank-q": dict(q_lora_rank=24), "full-q-rotate-half": dict(q_lora_rank=None, rope_interleave=False)}
# The names SGLang/vLLM (`deepseek_eagle3.py`) and SpecForge (`DeepseekV3ForCausalLMEagle3`) give the weights.
UPSTREAM_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
                 "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                 "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
                 "midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.q_a_layernorm.weight",
                 "midlayer.self_attn.q_b_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight",
                 "midlayer.self_attn.kv_a_layernorm.weight", "midlayer.self_attn.kv_b_proj.weight",
                 "midlayer.self_attn.o_proj.weight"}


def randomize(draft: Eagle3Draft, seed=0) -> Eagle3Draft:
    """Unit-scale weights (attention far from uniform, so a wrong scale or rope shows) and a random vocabulary map."""
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        used = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
        draft.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft


def mla_draft(hidden=H, vocab=V, draft_vocab=VD, variant="low-rank-q", seed=0, **kw) -> Eagle3Draft:
    fields = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4, num_kv_heads=4, head_dim=8,
                  vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden, **MLA, **VARIANTS[variant])
    cfg = DraftConfig(**{**fields, **kw})
    return randomize(Eagle3Draft(cfg, max_positions=1024), seed)


@torch.no_grad()  # a loaded draft is frozen, a new one is not: autograd may pick other CPU kernels
def draft_logits(draft, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(1, T, H, generator=g)
    feats = torch.randn(1, T, 3 * H, generator=g)
    heads, dim, shared = draft.config.kv_cache_layout()
    kv = KVCache(1, 1, 16, heads, dim, torch.float32, "cpu", shared)
    batch = AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([0]), kv_len=16)
    return draft.logits(draft(emb, feats, torch.arange(T)[None], batch, fuse=True)), emb, feats


def reference_logits(draft, emb, feats):
    """The upstream layer written out in float64, keys decompressed per head (SpecForge's training form, not our
    absorbed one): attention input [input_layernorm(emb), hidden_norm(fc(f))], residual fc(f) un-normed."""
    cfg = draft.config
    w = {k: v.double() for k, v in draft.state_dict().items()}
    a = "midlayer.self_attn."
    T, nh, nope, rope, rank = emb.shape[1], cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank

    def rms(x, name):
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def lin(x, name):
        return x @ w[name + ".weight"].T

    def rotate(x, pos):  # x [T, heads, rope]
        ang = pos[:, None, None] * cfg.rope_theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
        cos, sin = ang.cos(), ang.sin()
        if cfg.rope_interleave:  # pairs (0, 1), (2, 3), ... rotate together
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        x1, x2 = x[..., :rope // 2], x[..., rope // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    h = lin(feats[0].double(), "fc")
    x = torch.cat([rms(emb[0].double(), "midlayer.input_layernorm.weight"), rms(h, "midlayer.hidden_norm.weight")], -1)
    q = lin(rms(lin(x, a + "q_a_proj"), a + "q_a_layernorm.weight"), a + "q_b_proj") if cfg.q_lora_rank \
        else lin(x, a + "q_proj")
    q_nope, q_rope = q.view(T, nh, nope + rope).split([nope, rope], -1)
    latent, k_rope = lin(x, a + "kv_a_proj_with_mqa").split([rank, rope], -1)
    k_nope, value = lin(rms(latent, a + "kv_a_layernorm.weight"), a + "kv_b_proj").view(T, nh, -1).split(
        [nope, cfg.v_head_dim], -1)
    pos = torch.arange(T, dtype=torch.float64)
    q = torch.cat([q_nope, rotate(q_rope, pos)], -1)
    k = torch.cat([k_nope, rotate(k_rope[:, None], pos).expand(T, nh, rope)], -1)
    scores = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    h = h + lin(torch.einsum("hts,shd->thd", scores.softmax(-1), value).reshape(T, -1), a + "o_proj")
    m = rms(h, "midlayer.post_attention_layernorm.weight")
    h = h + lin(F.silu(lin(m, "midlayer.mlp.gate_proj")) * lin(m, "midlayer.mlp.up_proj"), "midlayer.mlp.down_proj")
    return lin(rms(h, "norm.weight"), "lm_head")


def target_cfg(hidden=H, vocab=V):
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_computes_the_upstream_math(variant):
    draft = mla_draft(variant=variant)
    logits, emb, feats = draft_logits(draft)
    torch.testing.assert_close(logits[0].double(), reference_logits(draft, emb, feats), atol=1e-4, rtol=1e-4)
    if variant == "low-rank-q":
        assert set(draft.state_dict()) == UPSTREAM_KEYS
    assert draft.config.kv_cache_layout() == (1, 32 + 8, True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_and_load_round_trip_to_identical_logits(tmp_path, variant):
    draft = mla_draft(variant=variant)
    draft.config.aux_layer_ids = [1, 2, 3]
    save_draft(draft, tmp_path / "d", dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    # SGLang and vLLM read the config through transformers' DeepseekV3Config.
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "d")
    assert (hf.kv_lora_rank, hf.q_lora_rank, hf.qk_rope_head_dim, hf.v_head_dim, hf.num_hidden_layers) == \
        (32, draft.config.q_lora_rank, 8, 16, 1)
    back = load_draft(tmp_path / "d", target_cfg())
    assert back.config == draft.config
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)
    assert torch.equal(draft_logits(back)[0], draft_logits(draft)[0])


def test_upstream_checkpoint_loads(tmp_path):
    """A config.json as SGLang/vLLM/TorchSpec write it (DeepseekV3Config keys, YaRN as `type`, MoE keys the draft
    ignores) and weights under vLLM's `layers.0.*` names with the embedding shipped."""
    cfg = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
           "intermediate_size": 2 * H, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,
           "q_lora_rank": 24, **MLA, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                            "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1},
           "vocab_size": V, "draft_vocab_size": VD, "target_hidden_size": H, "hidden_act": "silu",
           "tie_word_embeddings": False, "n_routed_experts": 256, "first_k_dense_replace": 3, "torch_dtype": "bfloat16",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    draft = randomize(Eagle3Draft(DraftConfig.from_hf(cfg), max_positions=1024))
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in draft.state_dict().items()}
    save_file({**tensors, "embed_tokens.weight": torch.randn(V, H)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = load_draft(tmp_path, target_cfg())
    c = back.config
    assert c.mla and c.layout == "sglang" and (c.num_kv_heads, c.head_dim) == (4, 8)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_interleave
    assert c.capture_layers(6) == (2, 3, 4)
    assert torch.equal(draft_logits(back)[0], draft_logits(draft)[0])


@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_ttt_step_k_equals_inference_chain(variant):
    draft = mla_draft(vocab=32, draft_vocab=24, variant=variant, seed=1)
    g = torch.Generator().manual_seed(0)
    T, K = 9, 3
    table = torch.randn(32, H, generator=g)
    ids = torch.randint(0, 32, (1, T), generator=g)
    feats = torch.randn(1, T, 3 * H, generator=g)
    ttt = [draft.logits(o) for o in unroll(draft, table[ids], feats, K)]
    for t in range(T - K):
        ref = _inference_chain(draft, table, ids[0], feats[0], t, K)
        for k in range(K):
            torch.testing.assert_close(ttt[k][0, t], ref[k], atol=1e-4, rtol=1e-4, msg=f"step {k} index {t}")


def test_ttt_trains_the_latent_projections():
    draft = mla_draft(vocab=32, draft_vocab=24).train()
    g = torch.Generator().manual_seed(0)
    embeds, feats = torch.randn(2, 8, H, generator=g), torch.randn(2, 8, 3 * H, generator=g)
    teacher = teacher_from_logits(torch.randn(2, 8, 32, generator=g), torch.ones(2, 8, dtype=torch.bool),
                                  draft.d2t + torch.arange(24), draft.t2d)
    loss, _ = TTTModel(draft, steps=3)(embeds, feats, teacher)
    loss.backward()
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert getattr(draft.midlayer.self_attn, name).weight.grad.abs().sum() > 0, name


def test_misfits_are_refused(tmp_path):
    save_draft(mla_draft(), tmp_path / "d")
    for target, what in [(target_cfg(hidden=128), "hidden size"), (target_cfg(vocab=128), "vocabulary")]:
        with pytest.raises(EyasError, match=what) as e:
            load_draft(tmp_path / "d", target)
        assert "\n" not in str(e.value)
    save_draft(mla_draft(target_hidden_size=32), tmp_path / "t")
    with pytest.raises(EyasError, match="target hidden size 32"):
        load_draft(tmp_path / "t", target_cfg())
    with pytest.raises(EyasError, match="no speculators layout"):
        save_draft(mla_draft(), tmp_path / "s", layout="speculators")
    upstream = json.loads((tmp_path / "d" / "config.json").read_text())
    del upstream["kv_lora_rank"]
    with pytest.raises(EyasError, match="kv_lora_rank"):
        DraftConfig.from_hf(upstream)
    with pytest.raises(EyasError, match="qk_rope_head_dim must be even"):
        DraftConfig.from_hf({**upstream, "kv_lora_rank": 32, "qk_rope_head_dim": 7})


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    save_tiny("deepseek_v3", path, vocab_size=32)
    return path


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, adaptive=False), SpecConfig(4, 3, 8, adaptive=False)],
                         ids=["chain", "tree"])
def test_speculative_equals_greedy_on_deepseek_target(deepseek_dir, tmp_path, spec):
    save_draft(mla_draft(vocab=32, draft_vocab=24), tmp_path / "draft", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = [SamplingParams(max_tokens=n) for n in (20, 40, 40)]
    want = [s.output_ids for s in Engine(str(deepseek_dir), dtype="fp32", max_batch=3, max_len=256)
            .generate(prompts, params)]
    prof = Profiler("cpu")
    engine = Engine(str(deepseek_dir), dtype="fp32", max_batch=3, max_len=256, profiler=prof,
                    draft=str(tmp_path / "draft"), spec=spec)
    assert engine.decoder.kv.shared and engine.decoder.kv.k.shape[2:] == (1, engine.decoder.kv.max_len, 32 + 8)
    assert [s.output_ids for s in engine.generate(prompts, params)] == want
    assert max(prof.summary()["accept_histogram"]) > 1  # drafts were accepted, so tree compaction and extend ran


def test_draft_that_does_not_fit_the_target_is_refused_by_the_engine(deepseek_dir, tmp_path):
    save_draft(mla_draft(vocab=32, draft_vocab=24, target_hidden_size=32), tmp_path / "draft")
    with pytest.raises(EyasError, match="target hidden size 32") as e:
        Engine(str(deepseek_dir), dtype="fp32", max_batch=1, max_len=64, draft=str(tmp_path / "draft"))
    assert "\n" not in str(e.value)
