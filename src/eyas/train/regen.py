"""Regeneration: the target writes every assistant turn of the training conversations, batched.

Usage: regenerate(recipe, engine, tokenizer, pool.train)   # appends to <out>/data/regen-r<rank>.jsonl

Conversations go through the Engine a chunk at a time, one assistant turn per round (turn i's prompt
holds the target's own reply to turn i-1). Each finished chunk is appended to the JSONL file, so an
interrupted run resumes by skipping the ids already written. Under torchrun, rank r takes every
r-th conversation and writes its own file.
"""

from __future__ import annotations

import json

from tqdm import tqdm

from eyas.layers.sampling import SamplingParams
from eyas.models.tokenizer import encode_messages
from eyas.train.conversation import end_of_turn_ids
from eyas.train.prompts import Conversation, data_dir, drop_torn_tail, parse_record, write_jsonl


def regen_files(recipe):
    return sorted(data_dir(recipe).glob("regen-r*.jsonl"))


def _rows(recipe):
    for f in regen_files(recipe):
        drop_torn_tail(f)
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, start=1):
                if line.strip():
                    yield f"{f} line {n}", json.loads(line)


def done_ids(recipe) -> set[str]:
    """Ids written, kept or dropped: a resumed run neither repeats nor retries them."""
    return {row["id"] for _, row in _rows(recipe)}


def read_regenerated(recipe) -> list[Conversation]:
    """All regenerated conversations, in id order (independent of which rank wrote which)."""
    convs = [parse_record(row, where, "") for where, row in _rows(recipe) if "dropped" not in row]
    return sorted(convs, key=lambda c: c.id)


def _reply_round(engine, tokenizer, convs, turn: int, params, max_len: int, stats: dict) -> list[Conversation]:
    """Give each conversation that has a user turn number `turn` the target's reply to it."""
    jobs, prompts = [], []
    for c in convs:
        users = [i for i, m in enumerate(c.messages) if m["role"] == "user"]
        if turn >= len(users):
            continue
        ids = encode_messages(tokenizer, c.messages[: users[turn] + 1])
        if len(ids) + params.max_tokens + engine_margin(engine) > max_len:
            c.messages = c.messages[: users[turn]]  # no room for this turn: the conversation ends before it
            continue
        jobs.append((c, users[turn]))
        prompts.append(ids)
    if not prompts:
        return []
    seqs = engine.generate(prompts, [SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                                    max_tokens=params.max_tokens, seed=params.seed + i,
                                                    stop_token_ids=params.stop_token_ids)
                                     for i in range(len(prompts))])
    stats["generated_tokens"] = stats.get("generated_tokens", 0) + sum(len(s.output_ids) for s in seqs)
    for (c, at), s in zip(jobs, seqs):
        text = tokenizer.decode(s.output_ids, skip_special_tokens=True)
        if text.strip():
            c.messages.insert(at + 1, {"role": "assistant", "content": text})
        else:
            c.messages = c.messages[:at]  # an empty reply teaches nothing; end the conversation before it
    return [c for c, _ in jobs]


def engine_margin(engine) -> int:
    return engine.spec.lookahead if engine.spec else 1


def regenerate(recipe, engine, tokenizer, prompts: list[Conversation], rank: int = 0, world: int = 1,
               progress: bool = True) -> dict:
    cfg = recipe.regen
    path = data_dir(recipe) / f"regen-r{rank}.jsonl"
    todo = prompts[: cfg.max_samples] if cfg.max_samples else prompts
    already = done_ids(recipe)
    mine = [c for i, c in enumerate(todo) if i % world == rank and c.id not in already]
    stops = end_of_turn_ids(tokenizer, engine.config.eos_token_ids)
    chunk = 4 * cfg.batch
    stats = {"conversations": 0, "replies": 0, "dropped": 0, "generated_tokens": 0,
             "skipped_done": len(todo) // world - len(mine)}
    bar = tqdm(total=len(mine), desc="regen", unit="conv", disable=not progress)
    for start in range(0, len(mine), chunk):
        convs = [Conversation(c.id, [dict(m) for m in c.messages if m["role"] != "assistant"])
                 for c in mine[start: start + chunk]]
        turns = max(sum(m["role"] == "user" for m in c.messages) for c in convs)
        for turn in range(turns):
            params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                    seed=recipe.data.seed * 7919 + start * 31 + turn * 1_000_003,
                                    stop_token_ids=stops)
            stats["replies"] += len(_reply_round(engine, tokenizer, convs, turn, params, engine.max_len, stats))
        # Keep conversations up to their last assistant reply; those without one are dropped.
        rows = []
        for c in convs:
            last = max((i for i, m in enumerate(c.messages) if m["role"] == "assistant"), default=None)
            if last is None:  # every reply was empty, or the first prompt left no room for one
                stats["dropped"] += 1
                rows.append({"id": c.id, "dropped": "no reply"})
                continue
            rows.append(Conversation(c.id, c.messages[: last + 1]).to_sharegpt())
        write_jsonl(path, rows, append=True)
        stats["conversations"] += sum("dropped" not in r for r in rows)
        bar.update(len(convs))
    bar.close()
    return stats
