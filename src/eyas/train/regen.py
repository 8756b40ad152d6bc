"""Regeneration: the target writes every assistant turn of the training conversations, batched.

Usage: regenerate(recipe, engine, tokenizer, pool.train)   # appends to <out>/data/regen-r<rank>.jsonl

All conversations stream through one continuously batched Engine: a freed slot takes the next
conversation, or the next turn of one whose reply just finished (turn i's prompt holds the target's own
reply to turn i-1), so no batch ever drains waiting for its longest reply. Finished conversations are
appended to the JSONL file every FLUSH_ROWS, so an interrupted run resumes by skipping the ids already
written. With `[regen] sampled_copies = N` each prompt is also answered N more times, every turn sampled
at `sampled_temperature`, as conversations "<id>~s1" .. "<id>~sN" (the draft's soft labels are the
target's logits, so sampled contexts are as exactly labelled as greedy ones). Under torchrun, rank r takes
every r-th (prompt, copy) pair and writes its own file.
"""

from __future__ import annotations

import json

from tqdm import tqdm

from eyas.layers.sampling import SamplingParams
from eyas.models.tokenizer import encode_messages
from eyas.train.conversation import end_of_turn_ids
from eyas.train.prompts import Conversation, data_dir, drop_torn_tail, parse_record, read_conversations, write_jsonl


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
    """All regenerated conversations for training prompts, in id order (independent of which rank wrote
    which). Conversations of prompts now held out are left out: when the prompt pool grows between runs
    its shuffle changes, and replies written earlier may belong to prompts the new split holds out."""
    heldout = _heldout_ids(recipe)
    convs = [parse_record(row, where, "") for where, row in _rows(recipe)
             if "dropped" not in row and prompt_id(row["id"]) not in heldout]
    return sorted(convs, key=lambda c: c.id)


def _heldout_ids(recipe) -> set[str]:
    path = data_dir(recipe) / "heldout.jsonl"
    if not path.exists() or not path.stat().st_size:
        return set()
    return {c.id for c in read_conversations(path)}


def copy_id(conv_id: str, copy: int) -> str:
    """Copy 0 is the prompt's own reply, under the prompt's id; copies 1..N are sampled."""
    return f"{conv_id}~s{copy}" if copy else conv_id


def prompt_id(conv_id: str) -> str:
    """The id of the prompt a conversation answers (copy_id's inverse)."""
    base, sep, copy = conv_id.rpartition("~s")
    return base if sep and copy.isdigit() else conv_id


def plan_jobs(recipe, prompts: list[Conversation], rank: int, world: int):
    """(this rank's output file, the prompts, its (prompt index, copy) jobs not yet done, fresh stats): the
    same split whichever engine writes the replies, so a run resumes across engines."""
    cfg = recipe.regen
    path = data_dir(recipe) / f"regen-r{rank}.jsonl"
    todo = prompts[: cfg.max_samples] if cfg.max_samples else prompts
    already = done_ids(recipe)
    jobs = [(i, copy) for i in range(len(todo)) for copy in range(1 + cfg.sampled_copies)][rank::world]
    mine = [(i, copy) for i, copy in jobs if copy_id(todo[i].id, copy) not in already]
    stats = {"conversations": 0, "replies": 0, "sampled_replies": 0, "dropped": 0, "generated_tokens": 0,
             "skipped_done": len(jobs) - len(mine)}
    return path, todo, mine, stats


def regenerate(recipe, engine, tokenizer, prompts: list[Conversation], rank: int = 0, world: int = 1,
               progress: bool = True) -> dict:
    path, todo, mine, stats = plan_jobs(recipe, prompts, rank, world)
    job = _Regen(recipe, engine, tokenizer, path, stats)
    bar = tqdm(total=len(mine), desc="regen", unit="conv", disable=not progress)
    queue = iter(mine)
    while True:
        # Keep about one batch waiting behind the running ones: enough to refill freed slots, while
        # prompts are tokenized only shortly before they run.
        while len(engine.waiting) < engine.runner.kv.num_slots:
            nxt = next(queue, None)
            if nxt is None:
                break
            index, copy = nxt
            conv = todo[index]
            bar.update(job.start(index, copy, Conversation(copy_id(conv.id, copy), [
                dict(m) for m in conv.messages if m["role"] != "assistant"])))
        if not engine.has_work():
            break
        for seq in engine.step():
            bar.update(job.reply(seq))
        if len(job.rows) >= FLUSH_ROWS:
            job.flush()
    job.flush()
    bar.close()
    return stats


FLUSH_ROWS = 256  # finished conversations per append to the JSONL file (what an interrupted run can lose)


class _Regen:
    """Conversations in flight: each runs one assistant turn at a time, continuously batched with the
    others (turn i+1 starts as soon as turn i's reply is in); finished ones wait in `rows` for a flush."""

    def __init__(self, recipe, engine, tokenizer, path, stats):
        self.recipe, self.engine, self.tokenizer, self.path, self.stats = recipe, engine, tokenizer, path, stats
        self.stops = end_of_turn_ids(tokenizer, engine.config.eos_token_ids)
        self.active: dict[int, tuple[int, int, Conversation, int, int]] = {}  # seq id -> (index, copy, conv, turn, at)
        self.rows: list[dict] = []

    def start(self, index: int, copy: int, conv: Conversation, turn: int = 0) -> int:
        """Queue turn `turn` of `conv` (copy `copy` of prompt `index`); a conversation with no such turn (or no
        room for it) is finished. Returns how many conversations finished (0 or 1)."""
        users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
        if turn >= len(users):
            return self._finish(conv)
        cfg = self.recipe.regen
        ids = encode_messages(self.tokenizer, conv.messages[: users[turn] + 1])
        if len(ids) + cfg.max_tokens + self.engine.lookahead > self.engine.max_len:
            conv.messages = conv.messages[: users[turn]]  # no room for this turn: the conversation ends before it
            return self._finish(conv)
        # The seed depends on the conversation, turn and copy only, not on what else shares the batch. Copy 0
        # keeps the seed it always had; copy j adds j times an odd constant, so a prompt's copies differ in
        # the low 32 bits, all that the CPU's generator keeps of a seed.
        seed = (self.recipe.data.seed * 1_000_003 + index) * 64 + turn + copy * 0x9E3779B9
        temperature = cfg.sampled_temperature if copy else cfg.temperature
        seq = self.engine.add(ids, SamplingParams(temperature=temperature, top_p=cfg.top_p,
                                                  max_tokens=cfg.max_tokens, seed=seed, stop_token_ids=self.stops))
        self.active[seq.id] = (index, copy, conv, turn, users[turn])
        return 0

    def reply(self, seq) -> int:
        index, copy, conv, turn, at = self.active.pop(seq.id)
        self.stats["generated_tokens"] += len(seq.output_ids)
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        if not text.strip():
            conv.messages = conv.messages[:at]  # an empty reply teaches nothing; end the conversation before it
            return self._finish(conv)
        self.stats["replies"] += 1
        self.stats["sampled_replies"] += copy > 0
        conv.messages.insert(at + 1, {"role": "assistant", "content": text})
        return self.start(index, copy, conv, turn + 1)

    def _finish(self, conv: Conversation) -> int:
        """Keep the conversation up to its last assistant reply; one without any is recorded as dropped."""
        last = max((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), default=None)
        if last is None:  # every reply was empty, or the first prompt left no room for one
            self.stats["dropped"] += 1
            self.rows.append({"id": conv.id, "dropped": "no reply"})
        else:
            self.stats["conversations"] += 1
            self.rows.append(Conversation(conv.id, conv.messages[: last + 1]).to_sharegpt())
        return 1

    def flush(self):
        if self.rows:
            write_jsonl(self.path, self.rows, append=True)
            self.rows = []
