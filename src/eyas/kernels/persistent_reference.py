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
            self.layers[-1]["qkv"] = torch.cat([self.layers[-1][k] for k in "qkv"])
        d = shape.head_dim
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.k_cache = torch.zeros(shape.layers, shape.kv_heads, max_positions, d, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)

    def _norm(self, x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * weight

    def _rotary(self, positions):  # cos, sin [T, d] in HF's rotate-half layout
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

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
        lm_tiles, splits = -(-s.vocab // self.schedule.tiles.lm_head), self.schedule.tiles.attend_splits
        self.buf = {"ids": ids, "start": start, "row_mask": row_mask, "rotary": self._rotary(positions),
                    "h": self.embed[ids].clone(),  # the stream entering layer 0 is the embeddings
                    "q": torch.full((T, s.heads, s.head_dim), nan, dtype=self.dtype),
                    # each attention split's running maximum, sum and unnormalized output, per row and head
                    "part_m": torch.full((T, s.heads, splits), nan, dtype=self.dtype),
                    "part_l": torch.full((T, s.heads, splits), nan, dtype=self.dtype),
                    "part_acc": torch.full((T, s.heads, splits, s.head_dim), nan, dtype=self.dtype),
                    "act": torch.full((T, s.intermediate), nan, dtype=self.dtype),
                    "logits": torch.full((T, s.vocab), nan, dtype=self.dtype),
                    "tile_max": torch.full((T, lm_tiles), nan, dtype=self.dtype),
                    "tile_arg": torch.full((T, lm_tiles), -1, dtype=torch.long),
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
        if item.op == "lm_head":
            logits = self._norm(b["h"], self.final_norm) @ self.lm_head[a:e].T
            b["logits"][:, a:e] = logits
            top, at = logits.max(-1)  # the first index of each row's maximum within the tile
            b["tile_max"][:, item.part], b["tile_arg"][:, item.part] = top, at + a
            return
        if item.op == "argmax":
            best = b["tile_max"].argmax(-1)  # ties go to the lower tile, so the first index overall
            b["tokens"] = b["tile_arg"].gather(1, best[:, None])[:, 0]
            return
        w, d, rep = self.layers[item.layer], s.head_dim, s.heads // s.kv_heads
        if item.op == "qkv":
            self._qkv(item, w)
        elif item.op == "attend":
            self._attend_split(item)
        elif item.op == "o_proj":
            b["h"][:, a:e] += self._merged_attention() @ w["o"][a:e].T
        elif item.op == "gate_up":
            x = self._norm(b["h"], w["post_norm"])
            b["act"][:, a:e] = torch.nn.functional.silu(x @ w["gate"][a:e].T) * (x @ w["up"][a:e].T)
        elif item.op == "down":
            b["h"][:, a:e] += b["act"] @ w["down"][a:e].T
        else:
            raise ValueError(f"unknown work item {item.op}")

    def _attend_split(self, item: WorkItem) -> None:
        """Query head h over split j of the step's columns: the columns cut in attend_splits runs of
        ceil(columns / splits), each row's maximum score, sum of exponentials and unnormalized output there
        (a row that sees no column of the split: -inf, 0 and zeros)."""
        b, d, splits = self.buf, self.shape.head_dim, self.schedule.tiles.attend_splits
        h, j = divmod(item.part, splits)
        start, T = b["start"], b["ids"].shape[0]
        total = start + T
        chunk = -(-total // splits)
        lo, hi = min(total, j * chunk), min(total, (j + 1) * chunk)
        g = h // (self.shape.heads // self.shape.kv_heads)
        keys, values = self.k_cache[item.layer, g, lo:hi], self.v_cache[item.layer, g, lo:hi]
        visible = torch.cat([torch.ones(T, start, dtype=torch.bool), b["row_mask"]], dim=1)[:, lo:hi]
        scores = ((b["q"][:, h] @ keys.T) * d ** -0.5).masked_fill(~visible, float("-inf"))
        top = scores.max(-1).values if hi > lo else torch.full((T,), float("-inf"), dtype=self.dtype)
        p = torch.where(visible, (scores - top.clamp_min(-1e30)[:, None]).exp(), 0.0)
        b["part_m"][:, h, j], b["part_l"][:, h, j], b["part_acc"][:, h, j] = top, p.sum(-1), p @ values

    def _merged_attention(self) -> torch.Tensor:
        """[T, heads * head_dim]: each head's splits merged, every split scaled to the largest maximum."""
        b = self.buf
        top = b["part_m"].max(-1, keepdim=True).values                 # every row sees itself: finite
        scale = (b["part_m"] - top).exp()                                # a split it sees nothing of: 0
        out = (scale[..., None] * b["part_acc"]).sum(2) / (scale * b["part_l"]).sum(2)[..., None]
        return out.reshape(out.shape[0], -1)

    def _qkv(self, item: WorkItem, w: dict) -> None:
        """Rows a..e of a head of the fused [q; k; v] projection and their partners half a head on, rotated
        together (rotate-half pairs column c with c + d/2), written to q, or to the k or v cache."""
        b, s, d = self.buf, self.shape, self.shape.head_dim
        x = self._norm(b["h"], w["in_norm"])
        a, e = item.cols
        half, c = d // 2, a - item.part * d        # the pair's columns in the head: c..c+T and c+half..
        lo, hi = x @ w["qkv"][a:e].T, x @ w["qkv"][a + half:e + half].T
        first, second = torch.arange(c, c + e - a), torch.arange(c + half, c + half + e - a)
        if item.part < s.heads + s.kv_heads:        # q and k heads are rotated, v heads are not
            cos, sin = b["rotary"]
            lo, hi = lo * cos[:, first] - hi * sin[:, first], hi * cos[:, second] + lo * sin[:, second]
        cols, out = torch.cat([first, second]), torch.cat([lo, hi], dim=1)
        if item.part < s.heads:
            b["q"][:, item.part, cols] = out
            return
        slots = torch.arange(b["start"], b["start"] + out.shape[0])
        kv_head = item.part - s.heads
        cache = self.k_cache if kv_head < s.kv_heads else self.v_cache
        cache[item.layer, kv_head % s.kv_heads, slots[:, None], cols[None, :]] = out
