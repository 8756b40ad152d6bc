"""Regeneration through any OpenAI-compatible server (vLLM, SGLang, eyas serve) that holds the target.

Usage: regenerate_via_endpoint(recipe, tokenizer, pool.train, "http://gpu-node:8000")  # [regen] url = "..."

The same conversations, seeds and files as train/regen.py, but every assistant turn is one /v1/completions request
whose prompt is eyas's own token ids (the chat template applied by eyas, as training will tokenize it), so the
server never re-renders or re-tokenizes the conversation. Turns of one conversation run in order; `concurrency`
conversations are in flight at once so the server batches them. Finished conversations are appended to
data/regen-r<rank>.jsonl as they complete, so a resumed run skips them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from tqdm import tqdm

from eyas.errors import EyasError
from eyas.models.tokenizer import encode_messages
from eyas.train.conversation import end_of_turn_ids
from eyas.train.prompts import Conversation, write_jsonl
from eyas.train.regen import FLUSH_ROWS, copy_id, plan_jobs


def regenerate_via_endpoint(recipe, tokenizer, eos_ids, prompts: list[Conversation], url: str, rank: int = 0,
                            world: int = 1, progress: bool = True, concurrency: int = 16, transport=None) -> dict:
    cfg = recipe.regen
    path, todo, mine, stats = plan_jobs(recipe, prompts, rank, world)
    stops = list(end_of_turn_ids(tokenizer, eos_ids))
    with httpx.Client(base_url=url.rstrip("/").removesuffix("/v1"), timeout=3600, trust_env=False,
                      transport=transport) as client:
        model = _served_model(client, url)

        def converse(job):
            index, copy = job
            conv = todo[index]
            messages = [dict(m) for m in conv.messages if m["role"] != "assistant"]
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            out, tokens = [], 0
            for turn, at in enumerate(users):
                ids = encode_messages(tokenizer, _with_replies(messages, users, out, at + 1))
                if len(ids) + cfg.max_tokens > recipe.data.max_len:
                    break  # no room for this turn: the conversation ends before it
                seed = (recipe.data.seed * 1_000_003 + index) * 64 + turn + copy * 0x9E3779B9
                body = {"model": model, "prompt": ids, "max_tokens": cfg.max_tokens,
                        "temperature": cfg.sampled_temperature if copy else cfg.temperature, "top_p": cfg.top_p,
                        "seed": seed % (1 << 31), "stop_token_ids": stops, "skip_special_tokens": True}
                choice = _post(client, url, body)["choices"][0]
                text = choice.get("text") or ""
                tokens += len(choice.get("token_ids") or []) or len(tokenizer.encode(text, add_special_tokens=False))
                if not text.strip():
                    break  # an empty reply teaches nothing; the conversation ends before it
                out.append(text)
            return index, copy, conv, messages, users, out, tokens

        rows = []
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            for index, copy, conv, messages, users, out, tokens in tqdm(
                    pool.map(converse, mine), total=len(mine), desc="regen", unit="conv", disable=not progress):
                stats["generated_tokens"] += tokens
                if not out:
                    stats["dropped"] += 1
                    rows.append({"id": copy_id(conv.id, copy), "dropped": "no reply"})
                else:
                    stats["conversations"] += 1
                    stats["replies"] += len(out)
                    stats["sampled_replies"] += len(out) if copy else 0
                    kept = _with_replies(messages, users, out, users[len(out) - 1] + 1)
                    rows.append(Conversation(copy_id(conv.id, copy), kept).to_sharegpt())
                if len(rows) >= FLUSH_ROWS:
                    write_jsonl(path, rows, append=True)
                    rows = []
        if rows:
            write_jsonl(path, rows, append=True)
    return stats


def _with_replies(messages: list[dict], users: list[int], replies: list[str], upto: int) -> list[dict]:
    """messages[:upto] (system and user turns) with replies[k] after the k-th user turn."""
    out = []
    for i, m in enumerate(messages[:upto]):
        out.append(dict(m))
        k = users.index(i) if i in users else len(replies)
        if k < len(replies):
            out.append({"role": "assistant", "content": replies[k]})
    return out


def _served_model(client, url: str) -> str:
    try:
        return client.get("/v1/models").json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise EyasError(f"regen endpoint {url}: no model list at /v1/models ({e})") from None


def _post(client, url: str, body: dict) -> dict:
    try:
        r = client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        raise EyasError(f"regen endpoint {url} cannot be reached ({e.__class__.__name__}: {e})") from None
    if r.status_code != 200:
        raise EyasError(f"regen endpoint {url}/v1/completions answered {r.status_code}: {r.text[:300]}")
    return r.json()
