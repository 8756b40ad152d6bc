"""A plain-torch executor of the persistent step's work items (eyas.kernels.persistent_schedule).

It runs exactly the items a persistent kernel would, one item at a time, in any order the dependency
counters allow: in schedule order, or interleaved as W programs with their own queues could run them. Every
item computes a fixed function of the buffers it reads, so if the schedule's dependencies are complete,
every allowed order gives bit-identical logits; a missing dependency lets some order read a buffer before it
is written, and the results differ. Tests use it to prove the schedule, and the GPU kernel is checked
against it. Weights come by their HF names (a Llama-family checkpoint without q/k norm or qkv bias).
"""

from __future__ import annotations

import random

import torch

from eyas.kernels.persistent_schedule import DecoderShape, Schedule, Tiles, WorkItem, build_schedule, ready


def interleave(schedule: Schedule, queues: list[list[int]], rng: random.Random) -> list[int]:
    """One order in which programs running `queues` could finish their items: at each point a random
    program among those whose next item's counter is reached runs that item."""
    counts, heads, order = [0] * len(schedule.counters), [0] * len(queues), []
    while len(order) < len(schedule.items):
        live = [p for p, q in enumerate(queues) if heads[p] < len(q) and ready(schedule.items[q[heads[p]]], counts)]
        if not live:
            raise RuntimeError("no program can proceed: the queues deadlock")
        p = rng.choice(live)
        item = schedule.items[queues[p][heads[p]]]
        heads[p] += 1
        counts[item.signal] += 1
        order.append(item.index)
    return order


class PersistentReference:
    """One decoder's weights, KV cache and step buffers; `step` runs one step's items in a given order."""

    def __init__(self, weights: dict[str, torch.Tensor], shape: DecoderShape, rope_theta: float,
                 rms_norm_eps: float, max_positions: int, tiles: Tiles = Tiles(), dtype=torch.float32):
        self.shape, self.eps, self.dtype = shape, rms_norm_eps, dtype
        self.schedule = build_schedule(shape, tiles)

        def w(name):
            if name not in weights:
                raise KeyError(f"missing weight {name}")
            return weights[name].to(dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = weights["lm_head.weight"].to(dtype) if "lm_head.weight" in weights else self.embed
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(shape.layers):
            p = f"model.layers.{i}."
            self.layers.append({k: w(p + n) for k, n in [
                ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"), ("v", "self_attn.v_proj.weight"),
                ("o", "self_attn.o_proj.weight"), ("gate", "mlp.gate_proj.weight"), ("up", "mlp.up_proj.weight"),
                ("down", "mlp.down_proj.weight"), ("in_norm", "input_layernorm.weight"),
                ("post_norm", "post_attention_layernorm.weight")]})
        d = shape.head_dim
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.k_cache = torch.zeros(shape.layers, shape.kv_heads, max_positions, d, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)

    def _norm(self, x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * weight

    def _rope(self, x, positions):  # x [T, heads, d]; HF's rotate-half convention
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def step(self, ids: torch.Tensor, start: int, order: list[int] | None = None,
             positions: torch.Tensor | None = None, row_mask: torch.Tensor | None = None):
        """Run one step over T rows written to cache slots start..start+T-1. positions (default the slots)
        feed the rotary embedding; row_mask [T, T] says which new rows each row sees (default causal; a
        draft tree passes its ancestor mask). Returns (logits [T, vocab], argmax tokens [T])."""
        s, T = self.shape, ids.shape[0]
        if start + T > self.k_cache.shape[2]:
            raise ValueError(f"slots {start}..{start + T - 1} exceed the cache of {self.k_cache.shape[2]}")
        positions = torch.arange(start, start + T) if positions is None else positions
        row_mask = torch.ones(T, T).tril().bool() if row_mask is None else row_mask
        nan = float("nan")  # poisoned so that an item reading a buffer nobody wrote this step shows it
        self.buf = {"ids": ids, "start": start, "positions": positions, "row_mask": row_mask,
                    "h": torch.full((T, s.hidden), nan, dtype=self.dtype),
                    "x": torch.full((T, s.hidden), nan, dtype=self.dtype),
                    "q": torch.full((T, s.heads, s.head_dim), nan, dtype=self.dtype),
                    "attn": torch.full((T, s.heads * s.head_dim), nan, dtype=self.dtype),
                    "act": torch.full((T, s.intermediate), nan, dtype=self.dtype),
                    "logits": torch.full((T, s.vocab), nan, dtype=self.dtype),
                    "tokens": torch.full((T,), -1, dtype=torch.long)}
        counts = [0] * len(self.schedule.counters)
        for index in (range(len(self.schedule.items)) if order is None else order):
            item = self.schedule.items[index]
            if not ready(item, counts):
                raise RuntimeError(f"{item.op}({item.layer}, {item.part}) ran before its counter was reached")
            self._run(item)
            counts[item.signal] += 1
        return self.buf["logits"], self.buf["tokens"]

    def _run(self, item: WorkItem) -> None:
        b, s = self.buf, self.shape
        a, e = item.cols
        if item.op in ("attn_norm", "mlp_norm", "final_norm"):
            if item.op == "attn_norm" and item.layer == 0:
                b["h"] = self.embed[b["ids"]].clone()
            weight = self.final_norm if item.layer < 0 else self.layers[item.layer][
                "in_norm" if item.op == "attn_norm" else "post_norm"]
            b["x"] = self._norm(b["h"], weight)
            return
        if item.op == "lm_head":
            b["logits"][:, a:e] = b["x"] @ self.lm_head[a:e].T
            return
        if item.op == "argmax":
            b["tokens"] = b["logits"].argmax(-1)
            return
        w, d, rep = self.layers[item.layer], s.head_dim, s.heads // s.kv_heads
        if item.op == "qkv":
            g, x = item.part, b["x"]
            q = (x @ w["q"][g * rep * d:(g + 1) * rep * d].T).view(-1, rep, d)
            k = (x @ w["k"][g * d:(g + 1) * d].T).view(-1, 1, d)
            v = x @ w["v"][g * d:(g + 1) * d].T
            b["q"][:, g * rep:(g + 1) * rep] = self._rope(q, b["positions"])
            slots = slice(b["start"], b["start"] + x.shape[0])
            self.k_cache[item.layer, g, slots] = self._rope(k, b["positions"])[:, 0]
            self.v_cache[item.layer, g, slots] = v
        elif item.op == "attend":
            g, start, T = item.part, b["start"], b["ids"].shape[0]
            keys, values = self.k_cache[item.layer, g, :start + T], self.v_cache[item.layer, g, :start + T]
            visible = torch.cat([torch.ones(T, start, dtype=torch.bool), b["row_mask"]], dim=1)
            q = b["q"][:, g * rep:(g + 1) * rep]                       # [T, rep, d]
            scores = torch.einsum("trd,kd->rtk", q, keys) * d ** -0.5
            scores = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out = torch.einsum("rtk,kd->trd", scores, values)
            b["attn"][:, g * rep * d:(g + 1) * rep * d] = out.reshape(T, rep * d)
        elif item.op == "o_proj":
            b["h"][:, a:e] += b["attn"] @ w["o"][a:e].T
        elif item.op == "gate_up":
            x = b["x"]
            b["act"][:, a:e] = torch.nn.functional.silu(x @ w["gate"][a:e].T) * (x @ w["up"][a:e].T)
        elif item.op == "down":
            b["h"][:, a:e] += b["act"] @ w["down"][a:e].T
        else:
            raise ValueError(f"unknown work item {item.op}")
