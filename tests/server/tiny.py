"""A tiny random Llama with a real tokenizer and chat template, a real `eyas serve` subprocess to drive, and a
streaming request to it in a thread.

The tokenizer is a byte-level BPE trained in milliseconds on Python's own documentation strings, with the
ChatML special tokens, so chat templating, special-token skipping and incremental UTF-8 decoding are all real.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

VOCAB = 512
SERVING = re.compile(r"eyas: serving .* on (http://[^\s:]+:\d+) ")  # the line `eyas serve` logs once it serves
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _corpus() -> list[str]:
    import argparse
    import json
    import textwrap

    return [mod.__doc__ or "" for mod in (argparse, json, textwrap, os, subprocess)] * 3


def tiny_chat_model(path: Path, seed: int = 0, layers: int = 5, hidden: int = 64) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=tok.token_to_id("<|im_end|>"),
                                   bos_token_id=tok.token_to_id("<|endoftext|>"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class Server:
    """`python -m eyas.cli serve ...` on a loopback port the system chooses (`--port 0`: no other process can
    take it between a choice and the server's bind), read from the server's own log line; its output read as it
    comes; stopped (and reaped) on exit."""

    def __init__(self, model, *args: str, env: dict | None = None, startup_s: float = 120.0):
        self.url: str | None = None
        self.model = str(model)
        cmd = [sys.executable, "-m", "eyas.cli", "serve", "--model", self.model, "--port", "0",
               "--device", "cpu", *args]
        # Its own session, so a test can signal the server's whole process group as systemd or `timeout` would.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.startup_s = startup_s
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)
            found = SERVING.search(line)
            if found and self.url is None:
                self.url = found.group(1)

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.url and httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready within {self.startup_s}s:\n{self.log()}")

    def log(self) -> str:
        """What the server printed so far; all of it once it has exited."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._lines)

    def wait_exit(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.log()
        return rc

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log()
        return self.proc.returncode

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc):
        self.stop()


def open_stream(server, max_tokens: int):
    """Start a streaming completion in a thread; returns (first chunk seen event, result dict)."""
    started, result = threading.Event(), {"chunks": [], "error": None}

    def run():
        body = {"model": server.model, "prompt": "drain me", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["chunks"].append(line[6:])
                        started.set()
        except httpx.HTTPError as e:
            result["error"] = repr(e)
        started.set()

    t = threading.Thread(target=run)
    t.start()
    return started, result, t


def predictable_pair(target_dir: Path, draft_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """A target and an EAGLE-3 draft built so that drafts get accepted, which random weights never are at this
    vocabulary size: the target's layers add nothing (o_proj and down_proj are zero), so its residual stream is
    the token's embedding E[t] and its lm_head, a row permutation of E, makes it emit sigma(t). The draft's fc
    passes that embedding through and its lm_head is permuted by sigma twice, so its first guess, sigma(sigma(t)),
    is always right (deeper guesses repeat it and are mostly wrong): about two tokens per verify pass."""
    import torch
    from safetensors.torch import load_file, save_file

    from eyas.draft_config import DraftConfig
    from eyas.models.draft_io import save_draft
    from eyas.models.eagle3 import Eagle3Draft

    tiny_chat_model(target_dir, seed=seed)
    weights = load_file(str(target_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    sigma = torch.randperm(VOCAB, generator=g)
    embed = weights["model.embed_tokens.weight"]
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    head = torch.empty_like(embed)
    head[sigma] = embed                      # row sigma(t) is E[t]: argmax over rows gives sigma(t)
    weights["lm_head.weight"] = head
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})

    hidden = embed.shape[1]
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4, num_kv_heads=2, head_dim=16,
                      vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=hidden)
    draft = Eagle3Draft(cfg, max_positions=1024)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.02, generator=g)
        for n, p in draft.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden] = torch.eye(hidden)  # feature = [E[t]] * 3 -> E[t]
        draft.lm_head.weight[sigma[sigma]] = embed
        draft.d2t.zero_()
        draft.t2d.fill_(True)
    save_draft(draft, draft_dir, dtype=torch.float32)
    return target_dir, draft_dir
