"""Typed configuration: one normalized ModelConfig for every supported target architecture, and SpecConfig, the
speculative settings with their bounds. The EAGLE-3 draft's own config is draft_config.py."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.config_families import moe_fields, mla_fields, quantization_fields
from eyas.errors import EyasError

# HF architecture string -> family flags. One decoder implementation serves all of them; `moe` names the
# router (softmax top-k, or DeepSeek's sigmoid grouped top-k) and `mla` selects multi-head latent attention.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(family="llama"),
    "MistralForCausalLM": dict(family="mistral"),
    "Qwen2ForCausalLM": dict(family="qwen2", attention_bias=True),
    "Qwen3ForCausalLM": dict(family="qwen3", qk_norm=True),
    # Mixtral always renormalizes the top-k probabilities and has no such config key.
    "MixtralForCausalLM": dict(family="mixtral", moe="softmax", norm_topk_prob=True),
    "Qwen3MoeForCausalLM": dict(family="qwen3_moe", qk_norm=True, moe="softmax", norm_topk_prob=False),
    # Kimi-K2 ships model_type kimi_k2 with this architecture: same network, the family records which.
    "DeepseekV3ForCausalLM": dict(family="deepseek_v3", moe="sigmoid", norm_topk_prob=True, mla=True),
}


def validate_mla_dims(cfg, attention: str, who: str) -> None:
    """The latent-attention widths a target or draft config (`cfg`) must have; `attention` and `who` name
    it in the error."""
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, name) <= 0:
            raise EyasError(f"{attention} needs a positive {name}, got {getattr(cfg, name)}")
    if cfg.qk_rope_head_dim % 2:
        raise EyasError(f"{who}qk_rope_head_dim must be even for rotary embeddings, got {cfg.qk_rope_head_dim}")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
        raise EyasError(f"{who}q_lora_rank must be positive or null, got {cfg.q_lora_rank}")


@dataclass
class ModelConfig:
    """What the decoder needs to know, normalized from an HF `config.json`."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    # Mixture of experts; num_experts 0 means every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: list[int] = field(default_factory=list)  # layers whose MLP is sparse; the rest are dense
    n_shared_experts: int = 0
    scoring: str = "softmax"         # softmax top-k | sigmoid (DeepSeek-V3: bias-corrected grouped top-k)
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention; kv_lora_rank 0 means standard attention. For MLA, head_dim is the rotary
    # part (qk_rope_head_dim), as in transformers, and num_kv_heads = num_heads.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    mtp_layers: int = 0              # DeepSeek's multi-token-prediction layers stored past num_layers (not run)
    # Weights shipped quantized, kept quantized at load: {"method": "fp8", "block": [r, c]} or
    # {"method": "int4", "group_size": g (0: per row), "symmetric": bool} (compressed-tensors pack-quantized).
    quantization: dict | None = None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_cache_layout(self, tp_size: int) -> tuple[int, int, bool]:
        """(heads, head_dim, shared) of one rank's cache. MLA caches one latent per token that serves as key and
        value for every head, so it is one unsharded head holding [normed kv latent, rotated k_rope]."""
        if self.mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, True
        return self.num_kv_heads // tp_size, self.head_dim, False

    def __post_init__(self):
        self._validate_moe()
        self._validate_mla()
        if self.num_heads % self.num_kv_heads:
            raise EyasError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise EyasError(f"config field {name} must be positive, got {getattr(self, name)}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise EyasError(f"unsupported rope scaling type '{rope_type}'")

    def _validate_moe(self):
        if not self.num_experts:
            if self.moe_layers:
                raise EyasError(f"moe_layers {self.moe_layers} given but num_experts is 0")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise EyasError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                            f"({self.num_experts})")
        if self.moe_intermediate_size <= 0:
            raise EyasError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise EyasError(f"unsupported expert scoring '{self.scoring}'; use softmax or sigmoid")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise EyasError(f"moe_layers {self.moe_layers} reach outside the {self.num_layers} layers")
        if self.scoring == "sigmoid":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise EyasError(f"n_routed_experts {self.num_experts} is not divisible by n_group {self.n_group}")
            if self.num_experts // self.n_group < 2:
                raise EyasError(f"grouped routing ranks groups by their top-2 scores: n_group {self.n_group} leaves "
                                f"fewer than 2 of the {self.num_experts} experts per group")
            if not 1 <= self.topk_group <= self.n_group:
                raise EyasError(f"topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                raise EyasError(f"topk_group {self.topk_group} groups hold fewer experts than num_experts_per_tok "
                                f"{self.num_experts_per_tok}")

    def _validate_mla(self):
        if self.mla:
            validate_mla_dims(self, "multi-head latent attention", "")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(ARCHITECTURES)
            raise EyasError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {supported}")
        try:
            return cls._from_hf(hf, arch)
        except KeyError as e:
            raise EyasError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, hf: dict, arch: str) -> "ModelConfig":
        flags = dict(ARCHITECTURES[arch])
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        kv_heads = hf.get("num_key_value_heads") or heads
        rope_theta, rope_scaling = rope_settings(hf)
        if rope_scaling and rope_scaling["rope_type"] == "yarn":
            # transformers' default: the pretraining length is the config's max_position_embeddings.
            rope_scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
        eos = hf.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        extra = moe_fields(hf, flags)
        if flags.pop("mla", False):
            extra.update(mla_fields(hf))
            # Every head has its own key/value after decompression; the rotary tables cover the rope part only.
            kv_heads, head_dim = heads, extra["qk_rope_head_dim"]
        family = flags.pop("family")
        if hf.get("model_type") == "kimi_k2":
            family = "kimi_k2"
        return cls(
            architecture=arch,
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", flags.pop("attention_bias", False))),
            qk_norm=flags.pop("qk_norm", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            quantization=quantization_fields(hf.get("quantization_config")),
            **extra,
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        return cls.from_hf(read_config_json(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rope_settings(hf: dict) -> tuple[float, dict | None]:
    """transformers 5 folds rope settings into `rope_parameters`; older configs use rope_theta + rope_scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return float(theta), scaling


def read_config_json(path: Path) -> dict:
    """The config.json of a checkpoint directory (target or draft), with one clear error per way it is missing or
    malformed."""
    path = Path(path)
    if not path.exists():
        raise EyasError(f"model directory not found: {path}")
    if not path.is_dir():
        raise EyasError(f"not a model directory: {path}")
    cfg = path / "config.json"
    if not cfg.exists():
        raise EyasError(f"no config.json in {path}")
    try:
        hf = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise EyasError(f"config.json in {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(hf, dict):
        raise EyasError(f"config.json in {path} is not a JSON object (it holds a {type(hf).__name__})")
    return hf


# What the engine captures per speculative cycle, so the bounds of every speculative setting: a verify pass (and
# the draft's extend pass over steps + 1 accepted pairs) takes at most MAX_VERIFY_TOKENS new tokens per sequence,
# the slot-attention kernel's row limit (layers.attention.KERNEL_TOKENS) under which its CUDA graphs are captured;
# the draft's top-k takes at most MAX_SPEC_TOPK per row (kernels.topk.MAX_K, an unrolled loop).
MAX_VERIFY_TOKENS = 64
MAX_SPEC_STEPS = MAX_VERIFY_TOKENS - 1
MAX_SPEC_TOPK = 16


@dataclass
class SpecConfig:
    """SGLang's knobs with SGLang's meaning: draft depth, branching, tokens sent to verify (root included)."""

    steps: int = 3
    topk: int = 1
    draft_tokens: int | None = None
    # Above this many running sequences a step decodes plainly (the draft only keeps up): past the batch size
    # where verifying N tokens per sequence costs more than it saves, speculation would be slower. None = always.
    max_batch: int | None = None
    # Per batch-size bucket, speculate where it measures more tokens/s than plain decoding (spec_policy.py):
    # on by default, as `eyas serve` and `eyas generate` run, so that speculation never makes decoding slower. False
    # speculates at every step (--no-spec-adaptive): what a measurement of one speculative setting needs.
    adaptive: bool = True

    def __post_init__(self):
        if self.max_batch is not None and self.max_batch < 1:
            raise EyasError(f"speculation batch limit must be >= 1, got {self.max_batch}")
        if not 1 <= self.steps <= MAX_SPEC_STEPS:
            raise EyasError(f"--spec-steps must be in 1..{MAX_SPEC_STEPS}, got {self.steps}: a cycle verifies at "
                            f"most {MAX_VERIFY_TOKENS} tokens per sequence, the most the engine captures")
        if not 1 <= self.topk <= MAX_SPEC_TOPK:
            raise EyasError(f"--spec-topk must be in 1..{MAX_SPEC_TOPK}, got {self.topk}: the draft's top-k "
                            f"takes at most {MAX_SPEC_TOPK} per row")
        if self.topk == 1:
            # A chain has exactly one node per step: SGLang forces steps + 1 tokens.
            self.draft_tokens = self.steps + 1
            return
        most = 1 + self.topk + (self.steps - 1) * self.topk ** 2
        if self.draft_tokens is None:
            self.draft_tokens = min(self.steps * self.topk + 1, most, MAX_VERIFY_TOKENS)
        if not 2 <= self.draft_tokens <= most:
            raise EyasError(f"--spec-draft-tokens {self.draft_tokens} is impossible with {self.steps} steps and topk "
                            f"{self.topk}: it must be between 2 and {most} (1 + topk + (steps-1)*topk^2)")
        if self.draft_tokens > MAX_VERIFY_TOKENS:
            raise EyasError(f"--spec-draft-tokens must be at most {MAX_VERIFY_TOKENS}, got {self.draft_tokens}: a "
                            f"cycle verifies at most {MAX_VERIFY_TOKENS} tokens per sequence, the most the engine "
                            "captures")
