"""The family-specific fields of an HF config.json, normalized for ModelConfig.

Mixture-of-experts routing (Mixtral, Qwen3-MoE, DeepSeek-V3/Kimi-K2 under their own key names), multi-head
latent attention, and the quantization formats whose weights we keep packed at load.
"""

from __future__ import annotations

from eyas.errors import EyasError


def moe_fields(hf: dict, flags: dict) -> dict:
    """Expert counts and routing under the names each family uses (Mixtral, Qwen3-MoE, DeepSeek-V3)."""
    scoring = flags.pop("moe", None)
    norm_default = flags.pop("norm_topk_prob", True)
    if scoring is None:
        return {}
    layers = hf["num_hidden_layers"]
    experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0
    if "first_k_dense_replace" in hf:  # DeepSeek: the first k layers are dense, then every moe_layer_freq-th is sparse
        first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
        moe_layers = [i for i in range(first, layers) if i % freq == 0]
    else:  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step; Mixtral has neither and is sparse everywhere
        dense, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step") or 1
        moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if scoring == "sigmoid":
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise EyasError(f"unsupported DeepSeek routing (scoring_func {hf.get('scoring_func')!r}, topk_method "
                            f"{hf.get('topk_method')!r}); only sigmoid with noaux_tc (DeepSeek-V3, Kimi-K2) "
                            "is supported")
    return dict(
        num_experts=experts if moe_layers else 0,
        num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        # Mixtral's experts are `intermediate_size` wide; the others name the expert width separately.
        moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        moe_layers=moe_layers if experts else [],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        scoring=scoring,
        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_default)),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )


def mla_fields(hf: dict) -> dict:
    try:
        return dict(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            # The original DeepSeek checkpoints store the rope dims as interleaved pairs; transformers defaults to it.
            rope_interleave=bool(hf.get("rope_interleave", True)),
            mtp_layers=hf.get("num_nextn_predict_layers") or 0,
        )
    except KeyError as e:
        raise EyasError(f"config.json lacks multi-head latent attention field {e.args[0]!r}") from None


def quantization_fields(q: dict | None) -> dict | None:
    """The two shipped weight formats we keep quantized at load; anything else is refused here, by name."""
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise EyasError("fp8 checkpoints must be block-quantized (quantization_config.weight_block_size, e.g. "
                            "[128, 128]); per-tensor fp8 is not supported")
        if q.get("fmt", "e4m3") != "e4m3":
            raise EyasError(f"unsupported fp8 format '{q.get('fmt')}'; only e4m3 is supported")
        return {"method": "fp8", "block": [int(b) for b in block]}
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        schemes = [g.get("weights") or {} for g in groups]
        formats = {g.get("format") or q.get("format") for g in groups}
        if not schemes or formats != {"pack-quantized"}:
            raise EyasError(f"unsupported compressed-tensors format {sorted(map(str, formats))}; only pack-quantized "
                            "int4 is supported")
        if any(w != schemes[0] for w in schemes) or any(g.get("input_activations") for g in groups):
            raise EyasError("compressed-tensors checkpoints with several weight schemes or activation quantization "
                            "are not supported")
        w = schemes[0]
        scheme = (w.get("num_bits"), w.get("type", "int"), w.get("strategy"))
        if scheme not in ((4, "int", "group"), (4, "int", "channel")) or w.get("actorder"):
            raise EyasError(f"unsupported compressed-tensors weights {w}; only int4 group or channel quantization "
                            "without activation ordering is supported")
        group = int(w["group_size"]) if w.get("strategy") == "group" else 0  # 0: one group per row
        return {"method": "int4", "group_size": group, "symmetric": bool(w.get("symmetric", True))}
    raise EyasError(f"unsupported quantization '{method}'; supported: fp8 (block-quantized) and compressed-tensors "
                    "(pack-quantized int4)")
