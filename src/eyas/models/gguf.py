"""Convert a llama.cpp GGUF file into an HF checkpoint directory (config, safetensors, tokenizer).

Usage: eyas convert-gguf SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2 --dtype bf16

Every tensor is dequantized, so the checkpoint reproduces the GGUF model (quantization error included), not the
original HF weights. Only the Llama and Qwen2 layouts are handled: they are the targets eyas serves. transformers
is used for the tokenizer and chat template only; the weight mapping below is ours.
"""

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from eyas.errors import EyasError
from eyas.paths import creatable_dir
from eyas.models.tensor_file import save_tensors

# Accepted spellings on the command line -> torch dtype.
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GGUF_MAGIC = b"GGUF"

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def convert_gguf(src: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Write `out_dir` holding config.json, model.safetensors, tokenizer files and generation_config.json.

    The directory appears all at once (built beside it, then renamed), so a crash never leaves half of one.
    """
    src, out_dir = Path(src), Path(out_dir)
    if dtype not in DTYPES:
        raise EyasError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    _check_source(src)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise EyasError(f"output directory {out_dir} already exists and is not an empty directory")
    creatable_dir(out_dir)  # before the (long) conversion, which would fail only at the end

    reader = _open(src)
    meta = _scalar_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise EyasError(f"{src.name}: architecture {arch!r} is not supported (eyas converts {', '.join(ARCHITECTURES)})")
    tensors = _load_tensors(reader, meta, arch, DTYPES[dtype])
    config = _hf_config(meta, arch, tensors, dtype=str(DTYPES[dtype]).removeprefix("torch."))
    tokenizer = _tokenizer(src, meta)

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EyasError(f"cannot create output directory {out_dir}: {e.strerror or e}") from None
    need, free = sum(t.numel() * t.element_size() for t in tensors.values()), shutil.disk_usage(out_dir.parent).free
    if free < need + (16 << 20):  # the weights, plus room for the tokenizer and config files
        raise EyasError(f"not enough disk space for {out_dir}: the weights need {need / 2**20:.0f} MiB, "
                        f"{out_dir.parent} has {free / 2**20:.0f} MiB free")
    # mkdir (not mkdtemp) so the result gets the user's umask instead of 0700.
    staging = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
    try:
        staging.mkdir()
        save_tensors(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        _write_json(staging / "config.json", config)
        # safetensors (0.8) creates its file 0600 whatever the umask; give the weights the mode our other files got.
        os.chmod(staging / "model.safetensors", (staging / "config.json").stat().st_mode & 0o777)
        _write_json(staging / "generation_config.json", _generation_config(meta))
        tokenizer.save_pretrained(staging)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename will not replace a directory on every platform
        os.rename(staging, out_dir)
    except OSError as e:
        raise EyasError(f"could not write {out_dir}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_source(src: Path) -> None:
    if not src.is_file():
        raise EyasError(f"GGUF file not found: {src}")
    with open(src, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise EyasError(f"{src} is not a GGUF file (bad magic)")


def _open(src: Path) -> GGUFReader:
    try:
        return GGUFReader(src)
    except (ValueError, IndexError, OSError) as e:
        raise EyasError(f"{src} is not a readable GGUF file: {e}") from e


def _scalar_metadata(reader: GGUFReader) -> dict:
    """Scalar and string fields; the big arrays (vocab, merges) are the tokenizer's business."""
    meta = {}
    for name, field in reader.fields.items():
        if not field.types or field.types[0] == GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        meta[name] = bytes(value).decode("utf-8") if field.types[0] == GGUFValueType.STRING else value.item()
    return meta


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF Llama/Qwen2 parameter name."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    match = LAYER_PATTERN.fullmatch(gguf_name)
    if match and match[2] in LAYER_NAMES:
        return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"
    if stem == "rope_freqs":
        # Llama 3.1-style rope scaling is stored as per-frequency factors we cannot turn back into HF's parameters.
        raise EyasError("GGUF uses rope_freqs (Llama 3.1 rope scaling), which eyas cannot convert")
    raise EyasError(f"unexpected tensor {gguf_name!r}; eyas converts only Llama and Qwen2 layouts")


def _load_tensors(reader: GGUFReader, meta: dict, arch: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    heads = _require(meta, f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise EyasError(f"tensor {t.name} uses quantization {t.tensor_type.name}, which gguf cannot dequantize") from None
        w = w.reshape(tuple(reversed(t.shape.tolist())))  # GGUF lists dims fastest-first; numpy wants rows first
        if arch == "llama" and ".q_proj." in name:
            w = _unpermute_rope(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _unpermute_rope(w, kv_heads)
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # F32 tensors are views of the read-only memory map; own a copy
            w = w.copy()
        tensors[name] = torch.from_numpy(w).to(dtype)
    if "model.embed_tokens.weight" not in tensors:
        raise EyasError("GGUF has no token_embd.weight tensor")
    return tensors


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row order for the llama architecture.

    llama.cpp rotates adjacent pairs (x0, x1), HF's rotate_half rotates (x_i, x_{i+d/2}); the converter reorders each
    head's rows with reshape(n_head, 2, d/2, ...).swapaxes(1, 2), so the inverse is the same reshape with the last two
    head axes swapped back. Qwen2 is exported unpermuted.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _require(meta: dict, key: str):
    if key not in meta:
        raise EyasError(f"GGUF metadata lacks {key}")
    return meta[key]


def _hf_config(meta: dict, arch: str, tensors: dict[str, torch.Tensor], dtype: str) -> dict:
    hidden = _require(meta, f"{arch}.embedding_length")
    heads = _require(meta, f"{arch}.attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    rope_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise EyasError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) are not supported")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _require(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _require(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _require(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": _require(meta, f"{arch}.context_length"),
        # The embedding's row count is the truth; metadata vocab_size is optional and sometimes stale.
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        # convert_hf_to_gguf drops output.weight when the HF model ties it to the embedding.
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
        config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in tensors
    return config


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _require(meta, f"{arch}.rope.scaling.factor")}
    raise EyasError(f"rope scaling type {kind!r} is not supported")


def _generation_config(meta: dict) -> dict:
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    # llama.cpp stops on end-of-turn as well as end-of-sequence; HF does so only if both are listed.
    eos = list(dict.fromkeys(eos))
    config = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos[0] if len(eos) == 1 else eos or None}
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return config


def _tokenizer(src: Path, meta: dict):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise EyasError(f"cannot build a tokenizer from {src.name}: {(str(e) or type(e).__name__).splitlines()[0]}") from e
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    return tokenizer


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
