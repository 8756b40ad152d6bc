"""The EAGLE-3 draft head's configuration, normalized from the EAGLE, SGLang/SpecForge or vLLM speculators
config.json, and the draft settings eyas refuses (rope scalings it does not compute as the engines do)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eyas.config import rope_settings, validate_mla_dims
from eyas.config_families import mla_fields
from eyas.errors import EyasError

# EAGLE-3 drafts whose decoder layer uses DeepSeek's latent attention (SGLang and vLLM `deepseek_eagle3.py`; SGLang
# registers the V3 name as an alias, vLLM maps both names to one class).
MLA_DRAFT_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def validate_draft_rope(scaling: dict | None) -> None:
    """Refuse a draft rope scaling eyas does not compute as the engines do. `dynamic` (NTK) rescales with the
    running sequence length past max_position_embeddings, and HF, vLLM and the EAGLE code each do it their way."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "dynamic":
        raise EyasError("draft rope_scaling type 'dynamic' is not supported: its frequencies change with the sequence "
                        "length past max_position_embeddings, which eyas does not implement")
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise EyasError(f"draft rope_scaling type '{kind}' is not supported (eyas implements linear, llama3, yarn)")


@dataclass
class DraftConfig:
    """An EAGLE-3 draft head, normalized from the EAGLE, SGLang/SpecForge or vLLM speculators config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int                 # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0     # EAGLE's default when the config has none (not the target's theta)
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    aux_layer_ids: list[int] | None = None  # SGLang meaning: "output of layer id" (captured input of id + 1)
    norm_before_residual: bool = False      # speculators option; vanilla EAGLE-3 is False
    # speculators/vLLM options (vanilla EAGLE-3 has all three False): feed the *normalised* output to the next
    # step (and the head reads it as is); one RMSNorm over the fused 3Ht features before fc; one per feature.
    norm_output: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    speculative_tokens: int | None = None   # the speculators config's proposal length, where it has one
    layout: str = "sglang"                  # where it came from: eagle | sglang | speculators
    # Multi-head latent attention (SGLang/vLLM `Eagle3DeepseekV2ForCausalLM`); kv_lora_rank 0 means the Llama layer.
    # As in ModelConfig, an MLA draft's head_dim is set to its rotary part and num_kv_heads to num_heads.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True            # DeepSeek's interleaved rope pairs, which SGLang and SpecForge always use
    attention_bias = False                  # not a field: upstream MLA drafts build every projection bias-free

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_cache_layout(self) -> tuple[int, int, bool]:
        """(heads, head_dim, shared) of the draft's cache: MLA caches one latent per token, as the target does."""
        if self.mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, True
        return self.num_kv_heads, self.head_dim, False

    def __post_init__(self):
        if self.mla:
            # Every head has its own key/value after decompression; the rotary tables cover the rope part only.
            self.num_kv_heads, self.head_dim = self.num_heads, self.qk_rope_head_dim
        if self.num_heads % self.num_kv_heads:
            raise EyasError(f"draft num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise EyasError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({self.vocab_size})")
        if self.mla:
            validate_mla_dims(self, "draft latent attention", "draft ")
        if self.norm_before_fc and self.fc_norm:
            raise EyasError("draft config sets both norm_before_fc and fc_norm; they are exclusive (speculators refuses both)")
        validate_draft_rope(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf: dict) -> "DraftConfig":
        arch = (hf.get("architectures") or [""])[0]
        if "speculators_config" in hf or "transformer_layer_config" in hf:
            layer = hf.get("transformer_layer_config") or {}
            merged = {**layer, **{k: v for k, v in hf.items() if k != "transformer_layer_config"}}
            merged.setdefault("vocab_size", hf.get("target_vocab_size", layer.get("vocab_size")))
            layout, aux = "speculators", hf.get("eagle_aux_hidden_state_layer_ids")
            # speculators ids are layer *inputs*; we store SGLang's "output of layer" meaning.
            aux = [i - 1 for i in aux] if aux else None
            # Absent: False, the default of speculators' Eagle3SpeculatorConfig (vLLM's update_eagle3 assumes True).
            nbr = bool(hf.get("norm_before_residual", False))
            proposals = (hf.get("speculators_config") or {}).get("proposal_methods") or [{}]
            spec_tokens = proposals[0].get("speculative_tokens")
        else:
            merged = hf
            layout = "sglang" if arch.endswith("Eagle3") or arch in MLA_DRAFT_ARCHITECTURES else "eagle"
            aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            # Absent: False, as vLLM reads these layouts; SGLang and the EAGLE code never read the key.
            nbr = bool(hf.get("norm_before_residual", False))
            spec_tokens = None
        # Read as vLLM reads them (SGLang and the EAGLE code ignore all three); norm_before_fc may sit in eagle_config.
        flags = {k: bool(merged.get(k, False)) for k in ("fc_norm", "norm_output")}
        flags["norm_before_fc"] = bool((merged.get("eagle_config") or {}).get("norm_before_fc",
                                                                             merged.get("norm_before_fc", False)))
        try:
            heads = merged["num_attention_heads"]
            theta, scaling = rope_settings(merged)
            if scaling and scaling["rope_type"] == "yarn":
                scaling.setdefault("original_max_position_embeddings", merged.get("max_position_embeddings", 2048))
            extra = {}
            if merged.get("kv_lora_rank") or arch in MLA_DRAFT_ARCHITECTURES:
                extra = mla_fields(merged)
                extra.pop("mtp_layers")
            return cls(
                hidden_size=merged["hidden_size"],
                intermediate_size=merged["intermediate_size"],
                num_heads=heads,
                num_kv_heads=merged.get("num_key_value_heads") or heads,
                head_dim=merged.get("head_dim") or merged["hidden_size"] // heads,
                vocab_size=merged["vocab_size"],
                draft_vocab_size=merged.get("draft_vocab_size") or merged["vocab_size"],
                target_hidden_size=merged.get("target_hidden_size") or merged["hidden_size"],
                rms_norm_eps=merged.get("rms_norm_eps", 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=merged.get("max_position_embeddings", 2048),
                aux_layer_ids=aux,
                norm_before_residual=nbr,
                speculative_tokens=spec_tokens,
                layout=layout,
                **flags,
                **extra,
            )
        except KeyError as e:
            raise EyasError(f"draft config.json lacks required field {e.args[0]!r}") from None

    def capture_layers(self, target_layers: int) -> tuple[int, ...]:
        """Target layers whose *input* feeds the draft (SGLang: explicit id + 1; default 2, L//2, L-3). Each must
        be a layer of the target: a draft trained for a deeper target names layers this one lacks."""
        layers = tuple(i + 1 for i in self.aux_layer_ids) if self.aux_layer_ids else \
            (2, target_layers // 2, target_layers - 3)
        if any(not 0 <= i < target_layers for i in layers):
            read = "aux_layer_ids " + str(list(self.aux_layer_ids)) if self.aux_layer_ids else "layers 2, L//2 and L-3"
            raise EyasError(f"the draft reads the target's hidden states at {read}, which a target of "
                            f"{target_layers} layers does not have: is the draft for another model?")
        return layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
