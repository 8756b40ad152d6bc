"""Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` list and the completions API's
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

The engine hands over a TokenLogprob per emitted token (the target's log-probability and the top
alternatives of the row it came from); here each token id becomes its text, decoded alone, as vLLM and
OpenAI show it. A token that holds only part of a UTF-8 character decodes to U+FFFD; `bytes` still carries
its own bytes for chat, so a client can join them.
"""

from __future__ import annotations


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0  # text_offset of the next completion token
        self._texts: dict[int, str] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"

    def text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._texts[token]

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes: a byte-level BPE piece maps back to its bytes exactly; others give their text's."""
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            byte_decoder = _byte_decoder()
            if isinstance(piece, str) and piece and all(c in byte_decoder for c in piece):
                return [byte_decoder[c] for c in piece]
        return list(self.text(token).encode("utf-8"))

    def chat(self, entries) -> dict:
        return {"content": [{**self._chat_one(e.token, e.logprob),
                             "top_logprobs": [self._chat_one(t, lp) for t, lp in e.top]} for e in entries]}

    def _chat_one(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": self.token_bytes(token)}

    def completion(self, entries) -> dict:
        tokens = [self.text(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        top = [{self.text(t): lp for t, lp in e.top} for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": top, "text_offset": offsets}


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes) -> byte."""
    if not _BYTE_DECODER:
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        chars, n = list(keep), 0
        for b in range(256):
            if b not in keep:
                keep.append(b)
                chars.append(256 + n)
                n += 1
        _BYTE_DECODER.update({chr(c): b for b, c in zip(keep, chars)})
    return _BYTE_DECODER
