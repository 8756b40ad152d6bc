"""A persistent decoder step: one Triton launch runs every work item of eyas.kernels.persistent_schedule.

W programs (on a GPU the SM count, so all are co-resident) each take the schedule's items dealt round-robin
(item i to program i % W) and run them in increasing index. An item spins on its producers' int32 counter
(an atomic add of 0 with acquire semantics) until it reaches the schedule's wait_count, does its work, then
synchronizes the program's threads and bumps its own counter with release semantics. Items are in
topological order, so the lowest unfinished item can always run: no dealing in order deadlocks.

The item table is the schedule itself (op, layer, columns, wait counter, wait count, signal counter as an
int32 tensor), so the counters' targets are the schedule's, and the test checks every counter ends at the
number of items that signal it. Norm items are kept as items (one program normalizes R rows and writes
them once) rather than recomputed by each consumer: the schedule stays the single source of the
dependencies.

Every buffer is written once per step (the residual stream has one slice per stage: h[0] the embeddings,
h[2l+1] after layer l's attention, h[2l+2] after its MLP; normed rows x[2l], x[2l+1], x[2L] likewise), so
there are no write-after-read hazards between items. Activations written by other programs are read with
cache_modifier=".cg" (L2, bypassing the SM's non-coherent L1). Activations are fp32; weights stay in the
target's dtype and products accumulate in fp32 (tl.dot over rows padded to 16).

Rotary uses the target's own cos/sin tables (any rope scaling), rotate-half: the qkv item stores the
unrotated q/k of its group to a scratch row, synchronizes, and reads each element with its rotation partner.

In Triton's interpreter (CPU tests) the programs of a grid run one after another, so a spin on another
program's counter would never end: CPU callers launch with W=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eyas.kernels.persistent_schedule import MAX_ROWS, DecoderShape, Schedule, Tiles, build_schedule

OPS = ("attn_norm", "qkv", "attend", "o_proj", "mlp_norm", "gate_up", "down", "final_norm", "lm_head", "argmax")
TABLE_COLUMNS = 7  # op, layer, part, col_start, col_end, wait counter (-1: none), wait count; then signal
BLOCK_ROWS = 16    # rows padded to tl.dot's minimum


def item_table(schedule: Schedule, device) -> torch.Tensor:
    """[items, 8] int32: op code, layer, part, first column, end column, wait counter, wait count, signal."""
    rows = [(OPS.index(i.op), i.layer, i.part, i.cols[0], i.cols[1], -1 if i.wait is None else i.wait,
             i.wait_count, i.signal) for i in schedule.items]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def expected_counts(schedule: Schedule) -> list[int]:
    """What each counter holds after a complete step: the number of items that signal it."""
    counts = [0] * len(schedule.counters)
    for item in schedule.items:
        counts[item.signal] += 1
    return counts


@triton.jit
def _wait(counters, wait, target):
    if wait >= 0:
        seen = tl.atomic_add(counters + wait, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(counters + wait, 0, sem="acquire")


@triton.jit
def _rows_times(x_ptr, x_stride, w_ptr, w_stride, n0, n_end, K, R: tl.constexpr, BR: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    """[BR, BN] fp32: rows x[:R, :K] (read through L2) times W[n0:n0+BN, :K]^T (columns past n_end are 0)."""
    rows = tl.arange(0, BR)
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BR, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + ks
        w = tl.load(w_ptr + cols[None, :] * w_stride + k[:, None], mask=(cols[None, :] < n_end) & (k[:, None] < K),
                    other=0.0)
        x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=(rows[:, None] < R) & (k[None, :] < K),
                    other=0.0, cache_modifier=".cg")
        acc += tl.dot(x.to(w.dtype), w, out_dtype=tl.float32)
    return acc


@triton.jit
def _touch(w, stride, r0, r1, K, sink, BN: tl.constexpr, BK: tl.constexpr):
    """Load rows r0..r1 of W [*, K] and discard them (a store that never happens keeps the loads): they are
    then in L2 when the item, after its wait, reads them for its product."""
    rn = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    total = tl.zeros((BN, BK), dtype=tl.float32)
    for n0 in range(r0, r1, BN):
        for k0 in range(0, K, BK):
            n = n0 + rn
            k = k0 + ks
            total += tl.load(w + n[:, None] * stride + k[None, :], mask=(n[:, None] < r1) & (k[None, :] < K),
                             other=0.0).to(tl.float32)
    s = tl.sum(tl.sum(total, axis=1), axis=0)
    tl.store(sink, s, mask=s != s)  # only a NaN weight would be written


@triton.jit
def _norm_rows(src, dst, weight, eps, H, R: tl.constexpr, BH: tl.constexpr):
    """dst[r] = rmsnorm(src[r]) * weight for each of R rows of width H (one row at a time: few registers)."""
    cols = tl.arange(0, BH)
    cm = cols < H
    w = tl.load(weight + cols, mask=cm, other=0.0).to(tl.float32)
    for r in tl.static_range(R):
        h = tl.load(src + r * H + cols, mask=cm, other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        tl.store(dst + r * H + cols, h * rstd * w, mask=cm)


@triton.jit
def persistent_step_kernel(
        table, n_items, counters, ids, pos,
        embed, attn_norm_w, wqkv, wo, mlp_norm_w, wgu, wd, final_norm_w, lm_head,
        cos, sin, k_cache, v_cache, c_layer, c_head, c_pos,
        h_buf, x_buf, raw_buf, q_buf, attn_buf, act_buf, logits, tokens, sink,
        eps, scale, L, H, I, V,
        R: tl.constexpr, NH: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
        BR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
        BV: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    W = tl.num_programs(0)
    REP: tl.constexpr = NH // KV
    QW: tl.constexpr = NH * D
    QKVW: tl.constexpr = (NH + 2 * KV) * D
    rows = tl.arange(0, BR)
    rmask = rows < R
    dcol = tl.arange(0, D)
    for it in range(pid, n_items, W):
        e = table + it * 8
        op = tl.load(e)
        layer = tl.load(e + 1)
        part = tl.load(e + 2)
        a = tl.load(e + 3)
        b = tl.load(e + 4)
        if PREFETCH:  # read the item's weights now, while its producers may still run: they land in L2
            if op == 1:
                wl = wqkv + layer.to(tl.int64) * QKVW * H
                _touch(wl, H, part * REP * D, (part + 1) * REP * D, H, sink, BN, BK)
                _touch(wl, H, QW + part * D, QW + part * D + D, H, sink, BN, BK)
                _touch(wl, H, QW + KV * D + part * D, QW + KV * D + part * D + D, H, sink, BN, BK)
            elif op == 3:
                _touch(wo + layer.to(tl.int64) * H * QW, QW, a, b, QW, sink, BN, BK)
            elif op == 5:
                _touch(wgu + layer.to(tl.int64) * 2 * I * H, H, a, b, H, sink, BN, BK)
                _touch(wgu + layer.to(tl.int64) * 2 * I * H, H, I + a, I + b, H, sink, BN, BK)
            elif op == 6:
                _touch(wd + layer.to(tl.int64) * H * I, I, a, b, I, sink, BN, BK)
            elif op == 8:
                _touch(lm_head, H, a, b, H, sink, BN, BK)
        _wait(counters, tl.load(e + 5), tl.load(e + 6))
        hl = h_buf + layer * 2 * R * H          # h[2l]: the stream entering layer l
        xl = x_buf + layer * 2 * R * H
        if op == 0:  # attn_norm; layer 0 first gathers the embeddings into h[0]
            if layer == 0:
                cols = tl.arange(0, BH)
                for r in tl.static_range(R):
                    tok = tl.load(ids + r).to(tl.int64)
                    emb = tl.load(embed + tok * H + cols, mask=cols < H, other=0.0)
                    tl.store(h_buf + r * H + cols, emb.to(tl.float32), mask=cols < H)
                tl.debug_barrier()
            _norm_rows(hl, xl, attn_norm_w + layer * H, eps, H, R, BH)
        elif op == 1:  # qkv of group `part`: projections, rotary, cache write
            wl = wqkv + layer.to(tl.int64) * QKVW * H
            raw = raw_buf + (layer * R * QKVW)
            kc = k_cache + layer.to(tl.int64) * c_layer + part * c_head
            vc = v_cache + layer.to(tl.int64) * c_layer + part * c_head
            m = rmask[:, None] & (dcol[None, :] < D)
            for j in tl.static_range(REP + 1):  # the group's query heads, then its key head: unrotated
                r0 = (part * REP + j) * D if j < REP else QW + part * D
                acc = _rows_times(xl, H, wl + r0 * H, H, 0, D, H, R, BR, D, BK)
                tl.store(raw + rows[:, None] * QKVW + r0 + dcol[None, :], acc, mask=m)
            acc = _rows_times(xl, H, wl + (QW + KV * D + part * D) * H, H, 0, D, H, R, BR, D, BK)
            tl.store(vc + (pos + rows)[:, None] * c_pos + dcol[None, :], acc.to(v_cache.dtype.element_ty), mask=m)
            tl.debug_barrier()
            for j in tl.static_range(REP + 1):
                r0 = (part * REP + j) * D if j < REP else QW + part * D
                if j < REP:
                    _rotate_rows(raw + r0, QKVW, q_buf + layer * R * QW + r0, QW, cos, sin, pos, R, BR, D)
                else:
                    _rotate_rows(raw + r0, QKVW, kc + pos * c_pos, c_pos, cos, sin, pos, R, BR, D)
        elif op == 2:  # attend: the group's query heads over cache positions < pos + r + 1
            kc = k_cache + layer.to(tl.int64) * c_layer + part * c_head
            vc = v_cache + layer.to(tl.int64) * c_layer + part * c_head
            m = rmask[:, None] & (dcol[None, :] < D)
            ts = tl.arange(0, BT)
            for j in tl.static_range(REP):
                hc = (part * REP + j) * D
                q = tl.load(q_buf + layer * R * QW + rows[:, None] * QW + hc + dcol[None, :], mask=m, other=0.0,
                            cache_modifier=".cg")
                best = tl.full((BR,), -1.0e30, tl.float32)
                total = tl.zeros((BR,), tl.float32)
                acc = tl.zeros((BR, D), tl.float32)
                for t0 in range(0, pos + R, BT):
                    t = t0 + ts
                    tm = t < pos + R
                    k = tl.load(kc + t[:, None] * c_pos + dcol[None, :], mask=tm[:, None], other=0.0,
                                cache_modifier=".cg")
                    v = tl.load(vc + t[:, None] * c_pos + dcol[None, :], mask=tm[:, None], other=0.0,
                                cache_modifier=".cg")
                    s = tl.dot(q.to(k.dtype), tl.trans(k), out_dtype=tl.float32) * scale
                    seen = (t[None, :] <= pos + rows[:, None]) & tm[None, :]
                    s = tl.where(seen, s, -1.0e30)
                    new_best = tl.maximum(best, tl.max(s, axis=1))
                    p = tl.where(seen, tl.exp(s - new_best[:, None]), 0.0)
                    fade = tl.exp(best - new_best)
                    total = total * fade + tl.sum(p, axis=1)
                    acc = acc * fade[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
                    best = new_best
                out = acc / tl.maximum(total, 1.0e-30)[:, None]
                tl.store(attn_buf + layer * R * QW + rows[:, None] * QW + hc + dcol[None, :], out, mask=m)
        elif op == 3:  # o_proj tile [a, b): h[2l+1] = h[2l] + attn Wo^T
            _project_add(attn_buf + layer * R * QW, QW, wo + layer.to(tl.int64) * H * QW, hl, hl + R * H,
                         a, b, QW, H, R, BR, BN, BK)
        elif op == 4:  # mlp_norm
            _norm_rows(hl + R * H, xl + R * H, mlp_norm_w + layer * H, eps, H, R, BH)
        elif op == 5:  # gate_up tile [a, b): act = silu(x Wg^T) * (x Wu^T)
            wl = wgu + layer.to(tl.int64) * 2 * I * H
            cn = tl.arange(0, BN)
            for n0 in range(a, b, BN):
                g = _rows_times(xl + R * H, H, wl, H, n0, b, H, R, BR, BN, BK)
                u = _rows_times(xl + R * H, H, wl + I * H, H, n0, b, H, R, BR, BN, BK)
                act = g / (1.0 + tl.exp(-g)) * u
                c = n0 + cn
                tl.store(act_buf + layer * R * I + rows[:, None] * I + c[None, :], act,
                         mask=rmask[:, None] & (c[None, :] < b))
        elif op == 6:  # down tile [a, b): h[2l+2] = h[2l+1] + act Wd^T
            _project_add(act_buf + layer * R * I, I, wd + layer.to(tl.int64) * H * I, hl + R * H, hl + 2 * R * H,
                         a, b, I, H, R, BR, BN, BK)
        elif op == 7:  # final_norm of h[2L]
            _norm_rows(h_buf + 2 * L * R * H, x_buf + 2 * L * R * H, final_norm_w, eps, H, R, BH)
        elif op == 8:  # lm_head tile [a, b)
            cn = tl.arange(0, BN)
            for n0 in range(a, b, BN):
                y = _rows_times(x_buf + 2 * L * R * H, H, lm_head, H, n0, b, H, R, BR, BN, BK)
                c = n0 + cn
                tl.store(logits + rows[:, None] * V + c[None, :], y, mask=rmask[:, None] & (c[None, :] < b))
        elif op == 9:  # argmax over the vocabulary, first index of the maximum
            cv = tl.arange(0, BV)
            best = tl.full((BR,), float("-inf"), tl.float32)
            where = tl.zeros((BR,), tl.int32)
            for v0 in range(0, V, BV):
                c = v0 + cv
                y = tl.load(logits + rows[:, None] * V + c[None, :], mask=rmask[:, None] & (c[None, :] < V),
                            other=float("-inf"), cache_modifier=".cg")
                top = tl.max(y, axis=1)
                at = tl.min(tl.where(y == top[:, None], c[None, :], V), axis=1)
                better = top > best
                where = tl.where(better, at, where)
                best = tl.where(better, top, best)
            tl.store(tokens + rows, where, mask=rmask)
        tl.debug_barrier()
        tl.atomic_add(counters + tl.load(e + 7), 1, sem="release")


@triton.jit
def _rotate_rows(raw, raw_stride, out, out_stride, cos, sin, pos, R: tl.constexpr, BR: tl.constexpr,
                 D: tl.constexpr):
    """out[r, c] = raw[r, c] cos + rotate_half(raw)[r, c] sin for one head of R rows at positions pos + r."""
    rows = tl.arange(0, BR)
    c = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (c + half) % D
    sign = tl.where(c < half, -1.0, 1.0)
    m = (rows[:, None] < R) & (c[None, :] < D)
    x = tl.load(raw + rows[:, None] * raw_stride + c[None, :], mask=m, other=0.0, cache_modifier=".cg")
    y = tl.load(raw + rows[:, None] * raw_stride + partner[None, :], mask=m, other=0.0, cache_modifier=".cg")
    p = pos + rows
    cs = tl.load(cos + p[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
    sn = tl.load(sin + p[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
    res = x * cs + sign[None, :] * y * sn
    tl.store(out + rows[:, None] * out_stride + c[None, :], res.to(out.dtype.element_ty), mask=m)


@triton.jit
def _project_add(x, x_stride, w, resid, dst, a, b, K, H, R: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    """dst[:, a:b] = resid[:, a:b] + x W[a:b]^T for rows x [R, K] and W [*, K]; dst and resid are [R, H]."""
    rows = tl.arange(0, BR)
    cn = tl.arange(0, BN)
    for n0 in range(a, b, BN):
        y = _rows_times(x, x_stride, w, K, n0, b, K, R, BR, BN, BK)
        c = n0 + cn
        m = (rows[:, None] < R) & (c[None, :] < b)
        r = tl.load(resid + rows[:, None] * H + c[None, :], mask=m, other=0.0, cache_modifier=".cg")
        tl.store(dst + rows[:, None] * H + c[None, :], r + y, mask=m)


@dataclass
class PackedDecoder:
    """A Llama-family target's weights stacked per kind across layers, in the target's dtype."""
    shape: DecoderShape
    embed: torch.Tensor        # [V, H]
    attn_norm: torch.Tensor    # [L, H]
    wqkv: torch.Tensor         # [L, (NH + 2 KV) D, H]: query heads, key heads, value heads
    wo: torch.Tensor           # [L, H, NH D]
    mlp_norm: torch.Tensor     # [L, H]
    w_gate_up: torch.Tensor    # [L, 2 I, H]: gate rows, then up rows
    w_down: torch.Tensor       # [L, H, I]
    final_norm: torch.Tensor   # [H]
    lm_head: torch.Tensor      # [V, H]
    cos: torch.Tensor          # [max positions, D], the target's rotary tables
    sin: torch.Tensor
    eps: float
    scale: float


def pack_llama(model) -> PackedDecoder:
    """Stack an eyas CausalLM's (eyas.models.llama) dense Llama weights; other variants keep today's path."""
    cfg = model.config
    if cfg.mla or cfg.moe_layers or cfg.qk_norm or cfg.attention_bias or model.tp.size != 1:
        raise ValueError("the persistent step covers dense Llama-family layers without qkv bias or q/k norm "
                         "on one rank")
    layers = model.model.layers
    shape = DecoderShape(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, layers=cfg.num_layers,
                         vocab=cfg.vocab_size)

    def stack(get):
        return torch.stack([get(layer).detach() for layer in layers]).contiguous()

    rotary = model.model.rotary
    return PackedDecoder(
        shape=shape, embed=model.model.embed_tokens.weight.detach(),
        attn_norm=stack(lambda x: x.input_layernorm.weight), wqkv=stack(lambda x: x.self_attn.qkv_proj.weight),
        wo=stack(lambda x: x.self_attn.o_proj.weight), mlp_norm=stack(lambda x: x.post_attention_layernorm.weight),
        w_gate_up=stack(lambda x: x.mlp.gate_up_proj.weight), w_down=stack(lambda x: x.mlp.down_proj.weight),
        final_norm=model.model.norm.weight.detach(), lm_head=model.lm_head.weight.detach(),
        cos=rotary.cos.float().contiguous(), sin=rotary.sin.float().contiguous(), eps=cfg.rms_norm_eps,
        scale=cfg.head_dim ** -0.5)


class PersistentStep:
    """The launch of one persistent step of `rows` rows with its item table, counters and step buffers,
    allocated once so that the launch can be captured in a CUDA graph."""

    def __init__(self, packed: PackedDecoder, rows: int, programs: int, tiles: Tiles = Tiles(),
                 block_n: int = 32, block_k: int = 64, block_t: int = 32, prefetch: bool = False,
                 num_warps: int = 4):
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"a persistent step takes 1..{MAX_ROWS} rows, not {rows}")
        s, dev = packed.shape, packed.embed.device
        self.packed, self.rows, self.programs = packed, rows, programs
        self.schedule = build_schedule(s, tiles)
        self.table = item_table(self.schedule, dev)
        self.expected = torch.tensor(expected_counts(self.schedule), dtype=torch.int32, device=dev)
        self.counters = torch.zeros(len(self.schedule.counters), dtype=torch.int32, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        qw, qkvw = s.heads * s.head_dim, (s.heads + 2 * s.kv_heads) * s.head_dim
        self.h = torch.zeros(2 * s.layers + 1, rows, s.hidden, **f32)
        self.x = torch.zeros(2 * s.layers + 1, rows, s.hidden, **f32)
        self.raw = torch.zeros(s.layers, rows, qkvw, **f32)
        self.q = torch.zeros(s.layers, rows, qw, **f32)
        self.attn = torch.zeros(s.layers, rows, qw, **f32)
        self.act = torch.zeros(s.layers, rows, s.intermediate, **f32)
        self.logits = torch.zeros(rows, s.vocab, **f32)
        self.tokens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.sink = torch.zeros(1, **f32)
        self.prefetch, self.num_warps = prefetch, num_warps
        self.blocks = dict(BR=BLOCK_ROWS, BH=triton.next_power_of_2(s.hidden), BN=block_n, BK=block_k, BT=block_t,
                           BV=256)
        if s.head_dim < 16 or s.head_dim & (s.head_dim - 1):
            raise ValueError(f"head_dim {s.head_dim} must be a power of two of at least 16")

    def __call__(self, ids: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """Run the step for tokens `ids` [rows] at positions pos..pos+rows-1 of one sequence's cache, k_cache and
        v_cache [L, KV, max_len, D] views (one slot of eyas's KVCache). Returns (logits, tokens)."""
        p, s = self.packed, self.packed.shape
        if ids.shape != (self.rows,):
            raise ValueError(f"expected {self.rows} token ids, got shape {tuple(ids.shape)}")
        if pos + self.rows > min(k_cache.shape[2], p.cos.shape[0]):
            raise ValueError(f"positions {pos}..{pos + self.rows - 1} exceed the cache or rotary table")
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
        self.counters.zero_()
        persistent_step_kernel[(self.programs,)](
            self.table, len(self.schedule.items), self.counters, ids, pos,
            p.embed, p.attn_norm, p.wqkv, p.wo, p.mlp_norm, p.w_gate_up, p.w_down, p.final_norm, p.lm_head,
            p.cos, p.sin, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            self.h, self.x, self.raw, self.q, self.attn, self.act, self.logits, self.tokens, self.sink,
            p.eps, p.scale, s.layers, s.hidden, s.intermediate, s.vocab,
            R=self.rows, NH=s.heads, KV=s.kv_heads, D=s.head_dim, **self.blocks, PREFETCH=self.prefetch,
            num_warps=self.num_warps)
        return self.logits, self.tokens

    def counters_complete(self) -> bool:
        """Whether every counter ended at the number of items that signal it (a finished step)."""
        return bool(torch.equal(self.counters, self.expected))
