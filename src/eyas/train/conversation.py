"""A conversation -> token ids + loss mask, with the target's own chat template.

Usage: sample = encode_conversation(tokenizer, messages, max_len=2048)

The mask is found by rendering the template incrementally, never by searching for separator strings:
for each assistant turn i, the text of `messages[:i]` with the generation prompt ends where the
assistant's writing starts, and the text of `messages[:i+1]` ends where it stops. Tokens whose
characters lie inside that window are the assistant's (its content and its end-of-turn marker); the
template's own tokens (role headers) and every other speaker's are not trained on. This works for any
template whose renderings of a conversation's prefixes are prefixes of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from eyas.errors import EyasError


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: token t was written by the assistant

    def __len__(self) -> int:
        return self.input_ids.numel()


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans each assistant turn adds to it."""
    full = render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = render(tokenizer, messages[:i], True)
        end = full if i + 1 == len(messages) else render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise EyasError("the chat template does not render conversations incrementally (an earlier turn "
                            "renders differently once later turns follow), so assistant tokens cannot be located")
        spans.append((len(start), len(end)))
    return full, spans


def encode_conversation(tokenizer, messages: list[dict], max_len: int) -> Sample:
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return _samples([enc["input_ids"]], [enc["offset_mapping"]], [spans], max_len)[0]


def _samples(ids: list[list[int]], offsets: list[list[tuple[int, int]]], spans: list[list[tuple[int, int]]],
             max_len: int) -> list[Sample]:
    """The samples of a chunk of tokenized conversations. A token is the assistant's when its characters (at
    least one) lie inside one of its conversation's assistant spans. Computed on the chunk's flat arrays at
    once: built one conversation at a time, the tensors cost more than the tokenizing."""
    ids = [x[:max_len] for x in ids]
    lengths = [len(x) for x in ids]
    n = sum(lengths)
    flat_ids = torch.from_numpy(np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=n))
    off = np.fromiter(chain.from_iterable(chain.from_iterable(o[:max_len] for o in offsets)), dtype=np.int64,
                      count=2 * n).reshape(-1, 2)
    owner = np.repeat(np.arange(len(ids)), lengths)
    mask = np.zeros(n, dtype=bool)
    for j in range(max(map(len, spans), default=0)):  # the j-th assistant turn of every conversation
        a = np.array([s[j][0] if j < len(s) else 1 for s in spans], dtype=np.int64)[owner]
        b = np.array([s[j][1] if j < len(s) else 0 for s in spans], dtype=np.int64)[owner]
        mask |= (off[:, 0] >= a) & (off[:, 1] <= b)
    mask &= off[:, 1] > off[:, 0]
    return [Sample(i, m) for i, m in zip(flat_ids.split(lengths), torch.from_numpy(mask).split(lengths))]


def trainable(sample: Sample) -> bool:
    """Whether a sample has a token to train on: an assistant token from index 2 on (the draft predicts one
    token ahead of the target)."""
    return int(sample.loss_mask[2:].sum()) > 0


def encode_all(tokenizer, convs, max_len: int, progress: bool = True, chunk: int = 1024) -> tuple[list[Sample], dict]:
    """The `trainable` samples of the conversations, and counts.

    Each chunk of conversations is tokenized in one batched call, which the fast tokenizers spread over
    the machine's cores (one call per conversation ran on one core: ~88 s for 72k conversations)."""
    from tqdm import tqdm

    samples, dropped = [], 0
    with tqdm(total=len(convs), desc="tokenize", unit="conv", disable=not progress, leave=False) as bar:
        for start in range(0, len(convs), chunk):
            rendered = [assistant_spans(tokenizer, c.messages) for c in convs[start:start + chunk]]
            enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
            for s in _samples(enc["input_ids"], enc["offset_mapping"], [spans for _, spans in rendered], max_len):
                if not trainable(s):
                    dropped += 1
                    continue
                samples.append(s)
            bar.update(len(rendered))
    if not samples:
        raise EyasError(f"none of the {len(convs)} conversations has assistant tokens within max_len {max_len}")
    return samples, {"samples": len(samples), "dropped_no_assistant_tokens": dropped,
                     "tokens": sum(len(s) for s in samples),
                     "trainable_tokens": sum(int(s.loss_mask.sum()) for s in samples)}


PLACEHOLDER = "\u2063EYAS-PLACEHOLDER\u2063"  # text no template rewrites and no user would type


def user_turn_prefix(tokenizer, system: str = "") -> list[int]:
    """Magpie: the template's text up to where a user's message starts (system turn included, if the
    template adds one). Given only this, an instruction-tuned target writes a plausible user question.
    `system`, when given, replaces the template's own system turn: it steers what kind of question comes."""
    messages = [{"role": "user", "content": PLACEHOLDER}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    from jinja2 import TemplateError

    try:
        text = render(tokenizer, messages, False)
    except TemplateError as e:  # a template that refuses a system turn raises through jinja
        raise EyasError(f"the chat template does not take a system message ({e}); leave [synth] system_prompts "
                        "empty") from None
    if system and system not in text:
        raise EyasError("the chat template drops the system message; leave [synth] system_prompts empty")
    cut = text.find(PLACEHOLDER)
    if cut < 0:
        raise EyasError("the chat template does not include the user's message verbatim; cannot synthesize prompts")
    return tokenizer(text[:cut], add_special_tokens=False)["input_ids"]


def end_of_turn_ids(tokenizer, eos_ids=()) -> tuple[int, ...]:
    """Tokens that end a turn: the model's EOS ids, the tokenizer's EOS, and the special token the template
    writes right after a message's content (`<|im_end|>`, `<|eot_id|>`, ...), found by rendering."""
    out = set(eos_ids)
    if tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    for role in ("user", "assistant"):
        msgs = [{"role": "user", "content": "x"}] if role == "assistant" else []
        text = render(tokenizer, msgs + [{"role": role, "content": PLACEHOLDER}], False)
        after = text[text.find(PLACEHOLDER) + len(PLACEHOLDER):]
        ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        if ids and ids[0] in set(tokenizer.all_special_ids):
            out.add(ids[0])
    return tuple(sorted(out))
