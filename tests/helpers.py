"""Tiny random models for tests, built with transformers' own config classes; and `run_script`, which runs a
benchmark script in the test's own process."""

from __future__ import annotations

import torch
import transformers

from eyas.draft_config import DraftConfig
from eyas.models.eagle3 import Eagle3Draft


def tiny_llama(path, vocab=64, layers=5, hidden=64, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=None, bos_token_id=None, **kw)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def smollm2_shaped_llama(path, seed=0):
    """Random weights in SmolLM2-135M's shape (30 layers, 9 query heads over 3 KV heads, tied embeddings): for
    what depends on the demo target's sizes and not its weights, such as a kernel's schedule or timing."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def random_draft(target_hidden: int, vocab: int, draft_vocab: int | None = None, seed=0, head_dim=16) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft_vocab = draft_vocab or vocab
    hidden = target_hidden  # the embedding is the target's, so the widths agree
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                      vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden)
    draft = Eagle3Draft(cfg, max_positions=1024)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.normal_(1.0, 0.1)
        used = torch.randperm(vocab)[:draft_vocab].sort().values
        draft.d2t.copy_(used - torch.arange(draft_vocab))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft


def run_script(script, *args) -> "subprocess.CompletedProcess":
    """A benchmark script's `python SCRIPT ARGS...` run in this process, for the checks of its bad-input paths
    (one line, exit 2 before any work), where a subprocess would spend seconds importing torch. Returns what
    subprocess.run(capture_output=True, text=True) would; an exception that the script lets escape escapes
    here too, failing the test as a traceback would."""
    import contextlib
    import io
    import os
    import runpy
    import subprocess
    import sys

    cmd = [str(script), *map(str, args)]
    out, err, argv, path = io.StringIO(), io.StringIO(), sys.argv, list(sys.path)
    sys.argv = cmd
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does: its siblings import
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            err.write(f"{e.code}\n")
    finally:
        sys.argv, sys.path[:] = argv, path
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())


def stop_process_group(proc, timeout: float = 60) -> None:
    """SIGTERM the session a server leads (its engine core and workers are in it), SIGKILL it after timeout."""
    import os
    import signal
    import subprocess

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
