"""The tokenized-samples cache: it returns exactly what tokenizing would, and only when nothing changed."""

import torch

from eyas.train import sample_cache
from eyas.train.conversation import encode_all
from eyas.train.prompts import Conversation
from tests.train.conftest import CONVERSATIONS, build_tokenizer


def conversations():
    return [Conversation(str(i), [dict(m) for m in c]) for i, c in enumerate(CONVERSATIONS)]


def test_a_saved_cache_loads_the_same_samples_and_only_under_its_key(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    convs = conversations()
    samples, stats = encode_all(tok, convs, 128, progress=False)
    key = sample_cache.cache_key(convs, tok, 128)
    path = tmp_path / "samples.safetensors"
    sample_cache.save(path, key, samples, stats)
    got, got_stats = sample_cache.load(path, key)
    assert got_stats == stats and len(got) == len(samples)
    for a, b in zip(got, samples):
        assert torch.equal(a.input_ids, b.input_ids) and a.input_ids.dtype == torch.int64
        assert torch.equal(a.loss_mask, b.loss_mask) and a.loss_mask.dtype == torch.bool
    # anything the tokens depend on changes the key: a conversation's text, max_len, the chat template
    edited = conversations()
    edited[0].messages[-1]["content"] += "!"
    assert sample_cache.cache_key(edited, tok, 128) != key
    assert sample_cache.cache_key(convs, tok, 64) != key
    tok.chat_template = tok.chat_template.replace("You are a test.", "You are a trial.")
    assert sample_cache.cache_key(convs, tok, 128) != key
    assert sample_cache.load(path, "another key") is None


def test_a_damaged_or_missing_cache_is_ignored(tmp_path):
    path = tmp_path / "samples.safetensors"
    assert sample_cache.load(path, "k") is None
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    assert sample_cache.load(path, "k") is None
