"""Tiny targets with a real tokenizer and chat template, built on the fly for the training tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_llama

TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a test.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. How are you today? I am fine, thank you.",
    "Write a short poem about the sea. The sea is wide and blue, the waves are tall and new.",
    "What is two plus two? Two plus two is four. Explain photosynthesis in one sentence.",
    "Plants turn light, water and air into sugar and oxygen. Tell me a joke about cats.",
]
VOCAB = 320


def build_tokenizer(path: Path):
    """A byte-level BPE with a ChatML template: real offsets, real special tokens, a vocabulary of ~300."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_target(path: Path, stop_bias: float = 0.0, seed: int = 0, sharpen: float = 30.0) -> Path:
    """tiny_llama + the tokenizer. `sharpen` scales the LM head so the random target has peaked, learnable
    next-token distributions (at init they are nearly uniform). `stop_bias` > 0 makes <|im_end|> likely
    (about 10% per token at 3.6), so that generation from a random model ends turns as a chat model does."""
    model = tiny_llama(path, vocab=VOCAB, layers=5, hidden=64, seed=seed)
    tok = build_tokenizer(path)
    with torch.no_grad():
        model.lm_head.weight *= sharpen
        if stop_bias:
            d = 0  # a residual dimension held constant: embeddings set it, no layer writes to it
            model.model.embed_tokens.weight[:, d] = 5.0
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[d] = 0
                layer.mlp.down_proj.weight[d] = 0
            model.lm_head.weight[:, d] = 0
            model.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>"), d] = stop_bias / 8.0
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """Runs record themselves in $EYAS_HOME's ledger: keep test runs out of the user's."""
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "eyas-home"))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def chatty_target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("chatty-target"), stop_bias=3.6, sharpen=1.0)


@pytest.fixture(scope="session")
def tokenizer(tiny_target):
    from eyas.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_target)


CONVERSATIONS = [
    [{"role": "user", "content": "How are you today?"}, {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "user", "content": "Write a short poem about the sea."},
     {"role": "assistant", "content": "The sea is wide and blue, the waves are tall and new."},
     {"role": "user", "content": "Tell me a joke about cats."},
     {"role": "assistant", "content": "Cats jump over the lazy dog, then ask what is two plus two."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Two plus two is four."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."},
     {"role": "assistant", "content": "Plants turn light, water and air into sugar and oxygen."}],
]


@pytest.fixture
def samples(tokenizer):
    """Training samples: the conversations above, varied so batches hold several lengths."""
    from eyas.train.conversation import encode_conversation

    out = []
    for rep in range(6):
        for conv in CONVERSATIONS:
            msgs = [dict(m) for m in conv]
            msgs[-1]["content"] = msgs[-1]["content"] + " Again." * rep
            out.append(encode_conversation(tokenizer, msgs, max_len=128))
    return out


def write_sharegpt(path: Path, n: int = 12) -> Path:
    rows = []
    for i in range(n):
        conv = CONVERSATIONS[i % len(CONVERSATIONS)]
        turns = [{"from": {"user": "human", "assistant": "gpt", "system": "system"}[m["role"]],
                  "value": m["content"] + (f" (variant {i})" if m["role"] == "user" else "")} for m in conv]
        rows.append({"id": f"conv-{i}", "conversations": turns})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
