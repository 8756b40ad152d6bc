"""Tokenizer and chat template from the checkpoint directory (transformers, local files only)."""

from __future__ import annotations

import os
from pathlib import Path

from eyas.errors import EyasError


# A checkpoint directory holding none of these has no tokenizer that transformers could load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        raise EyasError(f"cannot load the tokenizer from {path}: it holds none of {', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        # transformers' messages run over several lines; the whole of it, as one.
        raise EyasError(f"cannot load the tokenizer from {path}: {' '.join(str(e).split()) or type(e).__name__}") from None


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """`chat` wraps the text as one user turn with the model's chat template and the assistant prefix."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise EyasError("this model has no chat template; drop --chat")
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text, add_special_tokens=True)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
