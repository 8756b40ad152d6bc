"""Acceptance read off one teacher-forced pass: what the engine's greedy chain accepts, without generating.

Usage: preds = draft_predictions(target, draft, ids, steps=3)      # [steps, T] target token ids
       generated, passes = simulate_chain(preds, ids, prompt_len, spec_steps=3)
       right, total = teacher_forced_accuracy(preds, ids, prompt_len)  # per step, over the reply

Why it is exact (ttt.py's indexing): a greedy chain cycle that starts with tokens 0..L-1 committed runs the
draft's step k at position L-1+k, which is TTT step k at index L-2, with the draft's own guesses in place of
the true tokens. The guesses equal the true tokens for as long as they are accepted, so over the target's
greedy reply every cycle's accepted length follows from the teacher-forced predictions alone; the first
wrong guess ends the cycle before anything computed from it matters. tests/train/test_simulate.py checks
this against the Engine.

What it is for: the teacher-forced accuracy of held-out replies, next to the accuracy training logs on its
own batches, measures how much of the training accuracy carries over to text the draft never saw.
"""

from __future__ import annotations

import torch

from eyas.models.eagle3 import Eagle3Draft
from eyas.models.llama import CausalLM
from eyas.train.target import run_target
from eyas.train.ttt import unroll


@torch.no_grad()
def draft_predictions(target: CausalLM, draft: Eagle3Draft, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """ids [T] on the target's device -> [steps, T]: the target token the draft's step k guesses at index t
    (the one after x_{t+1+k}), from one forward of the target (its capture_layers set for this draft)."""
    x = ids[None]
    outs = unroll(draft, target.embed(x).to(draft.fc.weight.dtype), run_target(target, x).features, steps)
    return torch.stack([draft.to_target_ids(draft.logits(o).argmax(-1))[0] for o in outs])


def guess_hits(preds: torch.Tensor, ids: torch.Tensor) -> list[list[bool]]:
    """[k][t]: whether draft step k's guess at index t is x_{t+2+k}, for t < T - 2 - k."""
    T = ids.shape[0]
    return [(preds[k, : max(0, T - 2 - k)] == ids[2 + k:]).tolist() for k in range(preds.shape[0])]


def simulate_chain(preds: torch.Tensor, ids: torch.Tensor, prompt_len: int, spec_steps: int) -> tuple[int, int]:
    """preds [>= spec_steps, T], ids [T] = prompt + greedy reply. Returns (tokens generated after the first,
    verify passes): the engine's acceptance length is their ratio (the prefill's token is not counted)."""
    T = ids.shape[0]
    right = guess_hits(preds[:spec_steps], ids)
    committed, generated, passes = prompt_len + 1, 0, 0
    while committed < T:
        t, n = committed - 2, 0
        while n < spec_steps and committed + n < T and right[n][t]:
            n += 1
        step = min(n + 1, T - committed)
        committed, generated, passes = committed + step, generated + step, passes + 1
    return generated, passes


def teacher_forced_accuracy(preds: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> tuple[list[int], list[int]]:
    """Per draft step k: (right guesses, guesses) over the reply's tokens x_{prompt_len+1+k}.. (the first reply
    token comes from the prefill, never from a guess)."""
    hits = guess_hits(preds, ids)
    right = [sum(h[prompt_len - 1:]) for h in hits]
    total = [max(0, len(h) - (prompt_len - 1)) for h in hits]
    return right, total
