"""Tokens to text, a few at a time, and stop strings cut out of the text as it grows.

Decoding each new token alone is wrong twice over: byte-level BPE splits one UTF-8 character across tokens,
and SentencePiece decides a word's leading space from its neighbour. So each step decodes a short window that
starts a few tokens back, emits only what the window added, and holds back text that ends in an incomplete
character (U+FFFD) until the next token completes it (the offsets scheme vLLM and TGI use).
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output so the first output token has a neighbour


def fast_decoder(tokenizer):
    """`ids -> text` as tokenizer.decode(ids, skip_special_tokens=True) gives it. A fast tokenizer that does not
    clean up spaces decodes through its Rust backend directly: the same text, without the Python wrapper
    that costs several times the decode itself, twice per token and request on a loaded server."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], decode=None):
        self._decode = decode or fast_decoder(tokenizer)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0                # window start
        self.read = len(self.ids)      # tokens whose text has been emitted

    def add(self, new_ids: list[int]) -> str:
        """Text the new tokens add; may be empty while a character is incomplete."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """At the end, whatever is still held back, incomplete character and all."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopMatcher:
    """Streams text through, holding back any tail that could still become a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; after a match, the text before the stop string and `stopped` is set."""
        if self.stopped:
            return ""
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[:min(hits)], ""
            return out
        keep = self._partial_tail()
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(out):]
        return out

    def _partial_tail(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), best, -1):
                if self.held.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
