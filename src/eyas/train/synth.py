"""Self-synthesized prompts (Magpie): the target, given only the user-turn prefix, writes the question.

Usage: synthesize(recipe, engine, tokenizer)   # appends to <out>/data/synth-r<rank>.jsonl until [synth] num

Sampling at temperature ~1 makes every row a different question; rows that ran out of tokens (no
end-of-turn), are too short or long, are mostly non-ASCII letters, or repeat an earlier question are
dropped. Resumable: questions already in the file count towards `num` and are never written twice.

With `[synth] system_prompts`, rows are written under each system prompt in turn: a small target
asked for "a question" mostly asks one kind, and a system turn naming a kind of task (code, math, writing,
role-play, ...) moves it toward that kind. The system turn is not kept; the regeneration answers the
question under the template's default, as users' requests arrive.

With `[synth] openers`, the user's turn also starts with a word of the list (every system prompt with every
opener, taken in turn), and the kept question is the opener and what the target wrote after it. A small
target left alone asks chat questions ("I'm planning a trip, can you help?"); started with "Write",
"Explain" or "Implement" it writes the kind of task that evaluation sets and users give. `plain_per_opener`
= n writes n questions with no opener after each opened one, so both kinds stay in the data.
"""

from __future__ import annotations

import math
import sys

import torch

from tqdm import tqdm

from eyas.layers.sampling import SamplingParams
from eyas.train.conversation import end_of_turn_ids, user_turn_prefix
from eyas.train.prompts import (Conversation, ascii_ratio, data_dir, drop_torn_tail, normalize, read_conversations,
                                write_jsonl)


def keep_question(text: str, finish_reason: str | None, cfg) -> bool:
    return (finish_reason == "stop" and cfg.min_chars <= len(text) <= cfg.max_chars
            and ascii_ratio(text) >= cfg.min_ascii_ratio)


def question_starts(tokenizer, cfg) -> list[tuple[list[int], str]]:
    """What rows are written under, taken in turn: (prompt tokens, the question's opening text). One per
    [synth] system prompt (or the template's own system turn) and opener (or none), each opener followed by
    `plain_per_opener` starts with none."""
    openings = [o for opener in cfg.openers for o in [opener] + [""] * cfg.plain_per_opener] or [""]
    starts = []
    for system in cfg.system_prompts or [""]:
        prefix = user_turn_prefix(tokenizer, system)
        for opener in openings:
            opening = tokenizer(opener, add_special_tokens=False)["input_ids"] if opener else []
            starts.append((prefix + opening, opener))
    return starts


def synthesize(recipe, engine, tokenizer, rank: int = 0, world: int = 1, progress: bool = True) -> dict:
    cfg = recipe.synth
    path = data_dir(recipe) / f"synth-r{rank}.jsonl"
    drop_torn_tail(path)
    existing = read_conversations(path) if path.is_file() and path.stat().st_size else []
    seen = {normalize(c.first_user()) for c in existing}
    want = cfg.num // world + (1 if rank < cfg.num % world else 0)
    have = len(existing)
    starts = question_starts(tokenizer, cfg)
    stops = end_of_turn_ids(tokenizer, engine.config.eos_token_ids)
    stats = {"generated": 0, "generated_tokens": 0, "kept": 0, "dropped_filter": 0, "dropped_duplicate": 0}
    if rank == 0:
        print(f"eyas train: [synth] the target writes {want - min(have, want)} more questions ({have} already in "
              f"{path.name}; {want} wanted: [synth] num, with --num-samples the training prompts plus "
              f"[data] heldout = {recipe.data.heldout} held out), up to {cfg.max_tokens} tokens each, "
              f"{cfg.batch} at a time", file=sys.stderr, flush=True)
    bar = tqdm(total=want, initial=min(have, want), desc="synth", unit="prompt", disable=not progress)
    for round_ in range(cfg.max_rounds):
        if have >= want:
            break
        # Filters drop a share of rows; ask for a little more than is missing, at least one full batch.
        n = max(cfg.batch, math.ceil((want - have) * 1.3))
        base = (recipe.data.seed * 1_000_003 + rank) * 1_000_003 + round_ * 100_003 + have
        # One seed per round, not per request: unseeded rows share one batched draw per step (a seed per
        # row costs a random-number launch per row per step), and the round stays reproducible because
        # the engine admits and steps the same rows in the same order.
        torch.manual_seed(base)
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                stop_token_ids=stops)
        chosen = [starts[i % len(starts)] for i in range(n)]
        if not progress and rank == 0:  # no bar: each round says what it does
            print(f"eyas train: [synth] round {round_ + 1}: {n} questions asked, {have} of {want} kept so far",
                  file=sys.stderr, flush=True)
        seqs = engine.generate([ids for ids, _ in chosen], params)
        rows = []
        for (_, opening), s in zip(chosen, seqs):
            stats["generated"] += 1
            stats["generated_tokens"] += len(s.output_ids)
            text = (opening + tokenizer.decode(s.output_ids, skip_special_tokens=True)).strip()
            if not keep_question(text, s.finish_reason, cfg):
                stats["dropped_filter"] += 1
                continue
            key = normalize(text)
            if key in seen:
                stats["dropped_duplicate"] += 1
                continue
            if have + len(rows) >= want:
                break
            seen.add(key)
            rows.append(Conversation(f"synth-r{rank}-{have + len(rows):06d}", [{"role": "user", "content": text}]))
        write_jsonl(path, [r.to_sharegpt() for r in rows], append=True)
        have += len(rows)
        stats["kept"] += len(rows)
        bar.update(len(rows))
    bar.close()
    if have < want:
        print(f"eyas train: synthesized {have} of {want} prompts after {cfg.max_rounds} rounds (filters dropped "
              f"{stats['dropped_filter']}, duplicates {stats['dropped_duplicate']})", file=sys.stderr)
    return {**stats, "prompts": have}
