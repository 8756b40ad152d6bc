"""HF checkpoint directory -> a CausalLM on the requested device, driven by a name table.

The model is built on the meta device, materialized empty on the target device, and filled by
streaming safetensors (single file or sharded with an index). Every parameter must be filled and
every checkpoint key must be used, or loading fails with one line naming the key. Quantized checkpoints
stay quantized: the safetensors headers say which linears and experts ship packed (models/quant.py), and
those modules are swapped for their quantized twins before any byte is read (layers/quant_linear.py,
models/quant_experts.py), which then take the checkpoint's pieces as they are.
"""

from __future__ import annotations

import itertools
import json
import re
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.config import ModelConfig
from eyas.tensor_parallel import SINGLE, TPContext
from eyas.errors import EyasError
from eyas.models.llama import CausalLM
from eyas.models.quant import PIECE_SUFFIX, castable, keep_quantized, quantized_modules

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}

# checkpoint suffix -> (our module suffix, fused shard)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}
# Latent attention keeps q_proj (and has no k/v projections) under its own name.
FUSED_MLA = {k: v for k, v in FUSED.items() if not k.startswith("self_attn.")}
# One expert's projection -> (param of the stacked experts, part of gate_up); Mixtral's w1/w3/w2 and the rest.
EXPERT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
EXPERT_PROJ = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
               "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise EyasError(f"unknown dtype '{name}'; use one of bf16, fp16, fp32") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError):
            raise EyasError(f"{index} is not a valid safetensors index") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise EyasError(f"shard {missing[0]} listed in {index.name} is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EyasError(f"no *.safetensors weights in {path}")
    return files


def iterate_tensors(files: list[Path]):
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    yield key, fh.get_tensor(key)
        except EyasError:
            raise
        except Exception as e:  # safetensors raises several types for truncated or garbled files
            raise EyasError(f"cannot read {f.name}: corrupted or not a safetensors file ({str(e).splitlines()[0]})") from None


def map_key(key: str, fused: dict = FUSED) -> tuple[str, str, object]:
    """'model.layers.3.self_attn.q_proj.weight' -> ('model.layers.3.self_attn.qkv_proj', 'weight', 'q');
    'model.layers.3.block_sparse_moe.experts.5.w3.weight' -> ('model.layers.3.mlp.experts', 'gate_up_proj', (5, 1)).
    A quantized weight's pieces keep their module: `X.weight_packed` -> 'weight', `X.weight_scale_inv` ->
    'weight_scale', an expert's `weight_scale` -> 'gate_up_proj_scale' (models/quant.PIECE_SUFFIX)."""
    module, _, param = key.rpartition(".")
    suffix = PIECE_SUFFIX.get(param)
    expert = EXPERT.match(module)
    if expert and suffix is not None and expert.group(3) in EXPERT_PROJ:
        prefix, e, proj = expert.groups()
        dst, part = EXPERT_PROJ[proj]
        return f"{prefix}.mlp.experts", dst + suffix, int(e) if part is None else (int(e), part)
    if suffix is not None:
        param = "weight" + suffix
    module = module.replace(".block_sparse_moe", ".mlp")  # Mixtral's router: block_sparse_moe.gate
    for src, (dst, shard) in fused.items():
        if module.endswith(src):
            return module[: -len(src)] + dst, param, shard
    return module, param, None


def load_weights(model: torch.nn.Module, tensors, tie: bool = False, prefix_map=map_key):
    """Copy (key, tensor) pairs into `model`, each cast to its parameter's dtype (routers stay fp32)."""
    params = dict(model.named_parameters())
    expected = set(params)
    filled = set()
    for key, tensor in tensors:
        if IGNORED.match(key):
            continue
        module_name, param, shard = prefix_map(key)
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise EyasError(f"unexpected weight '{key}' in checkpoint") from None
        full = f"{module_name}.{param}"
        quantized = getattr(module, "quantized", False)
        if param.endswith("_shape") and quantized:
            _load_piece(module, key, param, tensor, shard)  # a packed weight's logical shape: checked, not stored
            continue
        if full not in expected:
            raise EyasError(f"unexpected weight '{key}' in checkpoint")
        if castable(tensor.dtype) and castable(params[full].dtype):
            tensor = tensor.to(params[full].dtype)  # packed values and their scales are taken as shipped
        if quantized:
            _load_piece(module, key, param, tensor, shard)
        elif hasattr(module, "load"):
            module.load(param, tensor, shard)
        else:
            dst = getattr(module, param).data
            if dst.shape != tensor.shape:
                raise EyasError(f"weight {key} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
        filled.add(full)
        if tie and key == "model.embed_tokens.weight":
            model.lm_head.load("weight", tensor)
            filled.add("lm_head.weight")
    missing = sorted(expected - filled)
    if missing:
        raise EyasError(f"checkpoint is missing weight '{missing[0]}'" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def _load_piece(module, key: str, param: str, tensor: torch.Tensor, shard):
    """A quantized module's piece; its errors name the checkpoint key (a fused module has several)."""
    try:
        module.load(param, tensor, shard)
    except EyasError as e:
        raise EyasError(f"checkpoint weight {key}: {e}") from None


def _is_mtp(key: str, cfg: ModelConfig) -> bool:
    """DeepSeek-V3 ships its multi-token-prediction module as the layers just past the decoder; we don't run it."""
    m = LAYER.match(key)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.mtp_layers


def load_model(path: str | Path, dtype="bf16", device="cpu", tp: TPContext = SINGLE,
               max_positions: int | None = None) -> CausalLM:
    if str(path) == "demo":
        from eyas.models.demo import demo_model_path

        path = demo_model_path()
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    files = safetensors_files(path)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = CausalLM(cfg, tp, max_positions)
    # Cast on the meta device (free), then allocate: materializing in fp32 first would need twice the bf16 bytes.
    model = model.to(dtype)
    for module in model.modules():  # routers score experts in fp32, as the reference does (models/moe.py)
        if getattr(module, "keep_fp32", False):
            module.float()
    prefix_map = partial(map_key, fused=FUSED_MLA if cfg.mla else FUSED)
    skip = partial(_is_mtp, cfg=cfg) if cfg.mtp_layers else (lambda key: False)
    if cfg.quantization:  # after the cast above, which would turn fp8 values and scales into `dtype`
        keep_quantized(model, quantized_modules(files, cfg.quantization, skip), cfg.quantization, prefix_map, dtype)
    model = model.to_empty(device=device)
    model.model.rotary.reset_buffers()
    tensors = ((k, t) for k, t in iterate_tensors(files) if not skip(k))
    load_weights(model, tensors, tie=cfg.tie_word_embeddings, prefix_map=prefix_map)
    return model.eval().requires_grad_(False)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the loaded model's parameters and buffers hold."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
