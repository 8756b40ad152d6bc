"""Where a draft's acceptance goes: its teacher-forced chain hits on the target's own greedy replies,
split by position in the reply and by whether the token continues a repetition.

Usage: python3 benchmarks/diagnose_acceptance.py --draft assets/smollm2-135m-eagle3 [--dataset mt-bench]
           [--prompts 16] [--new-tokens 256] [--steps 3] [--device cpu] [--out diagnosis.json]

The target (the demo model unless --model) writes greedy replies; one full forward then gives its features
and its greedy choice at every position, and the draft is unrolled over the sequence exactly as training
does (eyas.train.ttt.unroll). A chain starting at index t is accepted for as many leading steps as the
draft's top-1 equals the target's: 1 + the mean accepted run is the acceptance length teacher forcing
predicts (a token outside the draft vocabulary ends a chain, as in the engine). A token "repeats" when the
8 tokens ending with it already occurred earlier in the same sequence (greedy loops and copied spans).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eyas.bench.datasets import load_prompts
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from eyas.models.draft_io import load_draft
from eyas.models.tokenizer import encode_messages, load_tokenizer
from eyas.train.repeats import repeat_mask
from eyas.train.target import run_target
from eyas.train.ttt import teacher_from_logits, unroll

BUCKETS = ((0, 64), (64, 128), (128, 256), (256, 1 << 30))
NGRAM = 8


def repeats(ids: list[int], start: int) -> list[bool]:
    """For each position p >= start: do ids[p-NGRAM+1 .. p] occur earlier in ids? (The definition
    `[train] repeat_weight` trains with.)"""
    return repeat_mask(torch.tensor([ids]), NGRAM)[0, start:].tolist()


@torch.no_grad()
def chain_runs(target, draft, ids: list[int], reply_start: int, steps: int, device) -> list[tuple[int, int, bool]]:
    """(reply offset of the first drafted token, accepted run length, whether the target's token there is
    outside the draft vocabulary) for every chain start whose first drafted token lies in the reply and
    whose target choices all exist. A token outside the draft vocabulary can never be guessed: such a
    chain accepts nothing, as in the engine."""
    x = torch.tensor([ids], device=device)
    out = run_target(target, x)
    loss_mask = torch.zeros_like(x, dtype=torch.bool)
    loss_mask[:, reply_start:] = True
    used = torch.arange(draft.config.draft_vocab_size, device=device) + draft.d2t
    logits = target.logits(out.hidden)
    teacher = teacher_from_logits(logits, loss_mask, used, draft.t2d)
    outside = (~draft.t2d[logits.argmax(-1)])[0].tolist()
    outs = unroll(draft, target.embed(x), out.features, steps)
    T = len(ids)
    hits = []
    for k, o in enumerate(outs):
        n = T - 1 - k
        pred = draft.logits(o[:, :n]).argmax(-1)
        hits.append(((pred == teacher.ids[:, 1 + k:]) & teacher.valid[:, 1 + k:])[0].tolist())
    runs = []
    # Index t drafts x_{t+2} at step 0 (its features are f_t, its embedding x_{t+1}).
    for t in range(max(0, reply_start - 2), T - 1 - steps):
        r = 0
        while r < steps and hits[r][t]:
            r += 1
        runs.append((t + 2 - reply_start, r, outside[t + 1]))
    return runs


def summarize(rows: list[tuple[int, int, bool, bool]]) -> dict:
    """rows: (reply offset, accepted run, repeats, outside the draft vocabulary) per chain start."""
    def stats(sel):
        if not sel:
            return None
        runs = [x[1] for x in sel]
        return dict(chains=len(sel), predicted_accept_length=1 + sum(runs) / len(runs),
                    step0_hit_rate=sum(r > 0 for r in runs) / len(runs))

    out = dict(all=stats(rows), repeat=stats([x for x in rows if x[2]]), fresh=stats([x for x in rows if not x[2]]),
               fresh_in_vocabulary=stats([x for x in rows if not x[2] and not x[3]]),
               repeat_share=sum(x[2] for x in rows) / max(1, len(rows)),
               outside_vocabulary_share=sum(x[3] for x in rows) / max(1, len(rows)))
    out["by_reply_position"] = {f"{a}-{b if b < 1 << 30 else 'end'}": stats([x for x in rows if a <= x[0] < b])
                                for a, b in BUCKETS}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out", default="diagnosis.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(args.model, dtype=args.dtype, device=args.device, max_batch=args.prompts, max_len=2048)
    tok = load_tokenizer(engine.model_path if args.model != "demo" else _demo_dir())
    prompts = [encode_messages(tok, p.messages) for p in load_prompts(args.dataset)[: args.prompts]]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens))
    target = engine.target
    draft = load_draft(args.draft, target.config, next(target.parameters()).dtype, args.device)
    target.capture_layers = draft.config.capture_layers(target.config.num_layers)
    rows = []
    for s in seqs:
        ids = s.prompt_ids + s.output_ids
        flags = repeats(ids, len(s.prompt_ids))
        for offset, run, outside in chain_runs(target, draft, ids, len(s.prompt_ids), args.steps, args.device):
            rows.append((offset, run, flags[offset] if 0 <= offset < len(flags) else False, outside))
    result = dict(args=vars(args), seconds=round(time.perf_counter() - t0, 1), **summarize(rows))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def _demo_dir():
    from eyas.models.demo import demo_model_path

    return demo_model_path()


if __name__ == "__main__":
    main()
