"""Where a draft's acceptance goes: its teacher-forced guesses on the target's greedy replies (or on given
conversations), per draft step, per kind of token and per position in the reply.

Usage: python3 benchmarks/diagnose_acceptance.py --draft assets/smollm2-135m-eagle3 [--dataset mt-bench|humaneval|FILE]
           [--conversations out/RUN/data/regen-r0.jsonl] [--prompts 16] [--new-tokens 256] [--steps 3]
           [--device cpu] [--out diagnosis.json]

Prompts (`--dataset`): the target writes greedy replies with the draft as a chain of `--steps` through the
Engine, which counts its verify passes. One forward of the target then gives its features at every
position, and the draft is unrolled over the sequence exactly as training does (eyas.train.ttt.unroll).
From that one pass:
  - `accuracy_k`: each draft step's top-1 accuracy over the reply, the number the training log's `acc_k`
    gives on training batches;
  - `simulated_accept_length`: the chain cycles replayed on the guesses (train/simulate.py), which equals
    the Engine's `accept_length`, verify pass for verify pass, when the replay's forward matches the
    Engine's numerics (fp32);
  - `per_text_accept_length`: the replay's acceptance of each text, in order (MT-bench: 10 per category),
    and `per_text_outside_vocabulary_share`, the share of its reply tokens outside the draft vocabulary;
  - `outside_vocabulary_top`: the reply tokens outside the draft vocabulary that occur most often;
  - `simulated_accept_length_vocabulary_oracle`: the same replay with every guess of a token outside the
    draft vocabulary counted right: the most a larger draft vocabulary could give these replies (with
    `--oracle-vocabulary VOCAB.safetensors`, another run's `vocab.safetensors`: only the tokens that one
    holds, the most that vocabulary could give);
  - a chain started at every reply position: 1 + the mean accepted run ("predicted acceptance"), split by
    whether the token repeats (the 8 tokens ending with it already occurred in the sequence: greedy loops,
    copied spans), by position in the reply, and with the share of tokens outside the draft vocabulary
    (never guessed, as in the Engine).
Conversations (`--conversations`, ShareGPT or OpenAI-messages JSONL, e.g. a training run's regenerated
data): the same over the first reply as written, without generating: the draft's accuracy on the very
text it trained on, against held-out text.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BUCKETS = ((0, 64), (64, 128), (128, 256), (256, 1 << 30))
NGRAM = 8


def texts_from_prompts(args, tokenizer, stop_ids):
    """Prompt + greedy reply token lists, prompt lengths, the Engine's own acceptance, and the Engine (whose
    target and draft then score the replies: the models are loaded once)."""
    from eyas.bench.datasets import load_prompts
    from eyas.config import SpecConfig
    from eyas.engine.engine import Engine
    from eyas.layers.sampling import SamplingParams
    from eyas.models.tokenizer import encode_messages

    prompts = [encode_messages(tokenizer, p.messages) for p in load_prompts(args.dataset)[: args.prompts]]
    engine = Engine(args.model, dtype=args.dtype, device=args.device, draft=str(args.draft),
                    spec=SpecConfig(args.steps, 1, adaptive=False), max_batch=min(32, len(prompts)),
                    max_len=max(map(len, prompts)) + args.new_tokens + 16)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens, stop_token_ids=stop_ids))
    generated = sum(len(s.output_ids) - 1 for s in seqs)
    passes = sum(s.verify_passes for s in seqs)
    return ([p + s.output_ids for p, s in zip(prompts, seqs)], [len(p) for p in prompts],
            {"accept_length": generated / max(1, passes), "generated": generated, "passes": passes}, engine)


def texts_from_conversations(args, tokenizer) -> tuple[list[list[int]], list[int]]:
    """First replies as written: the prompt is everything before the first assistant token."""
    from eyas.train.conversation import encode_conversation
    from eyas.train.prompts import read_conversations

    texts, starts = [], []
    for conv in read_conversations(args.conversations):
        sample = encode_conversation(tokenizer, conv.messages, args.max_len)
        assistant = sample.loss_mask.nonzero().flatten().tolist()
        if not assistant or assistant[0] < 1:
            continue
        end = assistant[0]  # the first reply ends where the assistant's tokens first stop
        while end < len(sample) and sample.loss_mask[end]:
            end += 1
        texts.append(sample.input_ids[:end].tolist())
        starts.append(assistant[0])
        if len(texts) == args.prompts:
            break
    return texts, starts


def chain_starts(hits: list[list[bool]], ids: list[int], start: int, steps: int, t2d) -> list[tuple[int, int, bool, bool]]:
    """(reply offset of the first drafted token, accepted run, the token repeats, it is outside the draft
    vocabulary) for a chain started at every index whose chain lies within the sequence. The reply's first
    token comes from the prefill and is never drafted, so it is no chain start."""
    from eyas.train.repeats import repeat_mask

    T = len(ids)
    repeats = repeat_mask(torch.tensor([ids]), NGRAM)[0].tolist()
    rows = []
    for t in range(start - 1, T - 1 - steps):
        r = 0
        while r < steps and hits[r][t]:
            r += 1
        rows.append((t + 2 - start, r, repeats[t + 2], not bool(t2d[ids[t + 2]])))
    return rows


def oracle_predictions(preds: torch.Tensor, ids: torch.Tensor, t2d: torch.Tensor,
                       covered: torch.Tensor | None = None) -> torch.Tensor:
    """preds [steps, T] with each guess whose answer (x_{t+2+k}) lies outside the draft vocabulary (t2d) and,
    if given, inside `covered` (a larger vocabulary's t2d) replaced by that answer: a draft that always knew
    the tokens it cannot name."""
    out = preds.clone()
    outside = ~t2d.to(ids.device)[ids]
    if covered is not None:
        outside &= covered.to(ids.device)[ids]
    T = ids.shape[0]
    for k in range(preds.shape[0]):
        n = max(0, T - 2 - k)
        answer = ids[2 + k: 2 + k + n]
        out[k, :n] = torch.where(outside[2 + k: 2 + k + n], answer, preds[k, :n])
    return out


def summarize(rows: list[tuple[int, int, bool, bool]]) -> dict:
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


@torch.no_grad()
def diagnose(args) -> dict:
    from eyas.config import ModelConfig
    from eyas.models.demo import resolve_model_path
    from eyas.models.draft_io import load_draft
    from eyas.models.loader import load_model, parse_dtype
    from eyas.models.tokenizer import load_tokenizer
    from eyas.train.conversation import end_of_turn_ids
    from eyas.train.simulate import draft_predictions, guess_hits, simulate_chain, teacher_forced_accuracy

    t0 = time.perf_counter()
    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    engine_side = None
    if args.conversations:
        texts, starts = texts_from_conversations(args, tokenizer)
        if not texts:
            raise SystemExit(f"diagnose_acceptance: error: {args.conversations} holds no conversation with an "
                             "assistant reply after a prompt")
        target = load_model(args.model, args.dtype, args.device, max_positions=max(map(len, texts)) + 8)
        draft = load_draft(args.draft, target.config, dtype=parse_dtype(args.dtype), device=args.device)
        target.capture_layers = draft.config.capture_layers(target.config.num_layers)
    else:
        stop_ids = end_of_turn_ids(tokenizer, ModelConfig.from_dir(model_dir).eos_token_ids)
        texts, starts, engine_side, engine = texts_from_prompts(args, tokenizer, stop_ids)
        target, draft = engine.target, engine.decoder.draft
    K = max(args.steps, args.accuracy_steps)
    right, total, rows, per_text, per_text_oov = [0] * K, [0] * K, [], [], []
    outside = collections.Counter()
    t2d = draft.t2d.cpu()
    covered = None
    if args.oracle_vocabulary:
        from eyas.train.vocab import load_mapping

        covered = load_mapping(args.oracle_vocabulary).t2d
        if covered.numel() != t2d.numel():
            raise SystemExit(f"diagnose_acceptance: error: {args.oracle_vocabulary} maps {covered.numel()} target "
                             f"tokens, the draft {t2d.numel()}")
    generated = passes = oracle_generated = oracle_passes = 0
    for ids, start in zip(texts, starts):
        missing = [t for t in ids[start:] if not t2d[t]]
        outside.update(missing)
        per_text_oov.append(round(len(missing) / max(1, len(ids) - start), 4))
        x = torch.tensor(ids, device=args.device)
        preds = draft_predictions(target, draft, x, K)
        g, p = simulate_chain(preds, x, start, args.steps)
        generated, passes = generated + g, passes + p
        per_text.append(round(g / max(1, p), 3))
        og, op = simulate_chain(oracle_predictions(preds, x, t2d, covered), x, start, args.steps)
        oracle_generated, oracle_passes = oracle_generated + og, oracle_passes + op
        r, t = teacher_forced_accuracy(preds, x, start)
        right, total = [a + b for a, b in zip(right, r)], [a + b for a, b in zip(total, t)]
        rows += chain_starts(guess_hits(preds[: args.steps], x), ids, start, args.steps, t2d)
    return {"texts": len(texts), "reply_tokens": total[0],
            "accuracy_k": [round(a / max(1, b), 4) for a, b in zip(right, total)],
            "simulated_accept_length": generated / max(1, passes),
            "simulated_accept_length_vocabulary_oracle": oracle_generated / max(1, oracle_passes),
            "engine": engine_side,
            "seconds": round(time.perf_counter() - t0, 1), **summarize(rows),
            "per_text_accept_length": per_text, "per_text_outside_vocabulary_share": per_text_oov,
            "outside_vocabulary_top": [[tokenizer.decode([t]), n] for t, n in outside.most_common(40)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", type=Path, default=REPO / "assets" / "smollm2-135m-eagle3")
    p.add_argument("--model", default="demo", help="target: HF checkpoint directory or 'demo' (default)")
    p.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval, or a JSONL of prompts (in file order)")
    p.add_argument("--conversations", type=Path, help="score these conversations' first replies as written instead")
    p.add_argument("--prompts", type=int, default=16, help="prompts or conversations to use (default 16)")
    p.add_argument("--new-tokens", type=int, default=256, help="reply budget when generating (default 256)")
    p.add_argument("--max-len", type=int, default=1024, help="conversation tokens kept (default 1024)")
    p.add_argument("--steps", type=int, default=3, help="chain depth of the Engine and of the replay (default 3)")
    p.add_argument("--accuracy-steps", type=int, default=7, help="draft steps whose accuracy is reported (default 7)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--oracle-vocabulary", type=Path,
                   help="a vocab.safetensors: the vocabulary oracle fills in only the tokens it holds")
    p.add_argument("--out", type=Path, help="JSON results (also printed)")
    args = p.parse_args(argv)
    if min(args.prompts, args.steps, args.accuracy_steps, args.new_tokens) < 1:
        print("diagnose_acceptance: error: --prompts, --steps, --accuracy-steps and --new-tokens must be at least 1",
              file=sys.stderr)
        return 2
    return run_and_report("diagnose_acceptance", diagnose, args)


def run_and_report(script: str, work, args) -> int:
    """work(args)'s result, after the arguments, printed as JSON and written to args.out (if given): 0; or, for
    bad input the work finds (EyasError, OSError), one line `SCRIPT: error: ...`: 1. vocab_coverage.py ends
    the same way."""
    from eyas.errors import EyasError

    try:
        result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **work(args)}
    except (EyasError, OSError) as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
