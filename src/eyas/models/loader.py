"""HF checkpoint directory -> a CausalLM on the requested device, driven by a name table.

The model is built on the meta device, materialized empty on the target device, and filled by
streaming safetensors (single file or sharded with an index). Every parameter must be filled and
every checkpoint key must be used, or loading fails with one line naming the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.config import ModelConfig
from eyas.dist.parallel import SINGLE, TPContext
from eyas.errors import EyasError
from eyas.models.llama import CausalLM

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}

# checkpoint suffix -> (our module suffix, fused shard)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


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


def map_key(key: str) -> tuple[str, str, object]:
    """'model.layers.3.self_attn.q_proj.weight' -> ('model.layers.3.self_attn.qkv_proj', 'weight', 'q')."""
    module, _, param = key.rpartition(".")
    for src, (dst, shard) in FUSED.items():
        if module.endswith(src):
            return module[: -len(src)] + dst, param, shard
    return module, param, None


def load_weights(model: torch.nn.Module, tensors, dtype: torch.dtype, tie: bool = False, prefix_map=map_key):
    expected = {name for name, _ in model.named_parameters()}
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
        if full not in expected:
            raise EyasError(f"unexpected weight '{key}' in checkpoint")
        tensor = tensor.to(dtype)
        if hasattr(module, "load"):
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
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.reset_buffers()
    load_weights(model, iterate_tensors(files), dtype, tie=cfg.tie_word_embeddings)
    return model.eval().requires_grad_(False)
