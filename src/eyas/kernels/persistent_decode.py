"""A persistent decoder step: one Triton launch runs every work item of eyas.kernels.persistent_schedule.

W programs (on a GPU the SM count, so all are co-resident) each take the schedule's items dealt round-robin
(item i to program i % W) and run them in increasing index. Items are in topological order, so the lowest
unfinished item can always run: no dealing in order deadlocks. Each item first loads its weight tile into
registers (weights never depend on the step, so the load overlaps the producers still running), then polls
its producers' int32 counter with acquire loads until it reaches the schedule's wait_count, computes,
synchronizes the program's threads and bumps its own counter with release semantics.

The item table is the schedule itself (op, layer, part, columns, wait counter, wait count, signal counter as
an int32 tensor), so the counters' targets are the schedule's, and the tests check every counter ends at
the number of items that signal it.

Projections of one to eight rows are matrix-vector products on the CUDA cores: for each row, the weight
tile in registers times the row (fp32 products and sums, so an fp32 target is computed in full fp32). Only
the LM head, whose tiles are too large for registers, streams its weights through tl.dot over rows padded
to 16. Every buffer is written once per step (the residual stream has one slice per stage: h[2l+1] after
layer l's attention, h[2l+2] after its MLP; layer 0 reads the embedding rows directly), so there are no
write-after-read hazards between items. Activations written by other programs are read with
cache_modifier=".cg" (L2, bypassing the SM's non-coherent L1). Activations are fp32; weights stay in the
target's dtype.

In a traced step each item records three %globaltimer stamps (start, counter reached, done), from which
persistent_step.trace_summary tells where the step's time went. In Triton's interpreter (CPU tests) the
programs of a grid run one after another, so a spin on another program's counter would never end: CPU
callers launch with W=1. eyas.kernels.persistent_step owns the launch, its tables and buffers.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

OPS = ("qkv", "attend", "o_proj", "gate_up", "down", "lm_head", "argmax")  # the op codes of the item table


def split_pow2(k: int) -> tuple[int, int]:
    """Two power-of-two block widths that cover k columns (576 -> 512 + 64, 1536 -> 1024 + 512): a row or
    a weight tile is held as two register blocks, the second masked past k."""
    first = 1 << (k.bit_length() - 1)
    if first == k:
        first //= 2
    return first, triton.next_power_of_2(k - first)

@triton.jit
def _load_acquire(ptr, ON_GPU: tl.constexpr):
    """*ptr with acquire semantics: this item's later reads see what its producers wrote before their release
    add. On a GPU a plain acquire load (no read-modify-write, so spinning programs do not queue on one
    address); the interpreter has no inline PTX and takes an atomic add of 0."""
    if ON_GPU:
        seen = tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        seen = tl.atomic_add(ptr, 0, sem="acquire")
    return seen


@triton.jit
def _wait(counters, wait, target, ON_GPU: tl.constexpr):
    if wait >= 0:
        seen = _load_acquire(counters + wait, ON_GPU)
        while seen < target:
            seen = _load_acquire(counters + wait, ON_GPU)


@triton.jit
def _stamp(trace, it, k, TRACE: tl.constexpr):
    if TRACE:
        tl.store(trace + it * 3 + k, globaltimer())


@triton.jit
def _tile(w, stride, n0, n_end, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr):
    """Weight rows n0..n_end of W [*, K] (rows past n_end are 0) as two register blocks [BN, K1], [BN, K2]."""
    n = n0 + tl.arange(0, BN)
    c1 = tl.arange(0, K1)
    c2 = K1 + tl.arange(0, K2)
    nm = (n < n_end)[:, None]
    w1 = tl.load(w + n[:, None] * stride + c1[None, :], mask=nm, other=0.0)
    w2 = tl.load(w + n[:, None] * stride + c2[None, :], mask=nm & (c2[None, :] < K), other=0.0)
    return w1, w2


@triton.jit
def _row(src, K, K1: tl.constexpr, K2: tl.constexpr):
    """One fp32 row src[0:K], written by other programs (read through L2), as blocks [K1], [K2]."""
    c1 = tl.arange(0, K1)
    c2 = K1 + tl.arange(0, K2)
    x1 = tl.load(src + c1, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(src + c2, mask=c2 < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    return x1, x2


@triton.jit
def _normed_row(src, norm_w, eps, K, K1: tl.constexpr, K2: tl.constexpr):
    """rmsnorm(src[0:K]) * norm_w, as blocks [K1], [K2]."""
    x1, x2 = _row(src, K, K1, K2)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / K + eps)
    c1 = tl.arange(0, K1)
    c2 = K1 + tl.arange(0, K2)
    w1 = tl.load(norm_w + c1).to(tl.float32)
    w2 = tl.load(norm_w + c2, mask=c2 < K, other=0.0).to(tl.float32)
    return x1 * rstd * w1, x2 * rstd * w2


@triton.jit
def _gemv(w1, w2, x1, x2):
    """[BN] fp32: a weight tile held as two blocks times one row held as two blocks."""
    return tl.sum(w1.to(tl.float32) * x1[None, :], axis=1) + tl.sum(w2.to(tl.float32) * x2[None, :], axis=1)


@triton.jit
def _merged_attention(part_m, part_l, part_acc, base, K, K1: tl.constexpr, K2: tl.constexpr, S: tl.constexpr,
                      D: tl.constexpr):
    """One row's attention output [K = heads * D] as blocks [K1], [K2]: each head's S splits (their maxima,
    sums and unnormalized outputs from `base` = the row's first (head, split)) merged in split order."""
    c1 = tl.arange(0, K1)
    c2 = K1 + tl.arange(0, K2)
    x1 = _merge_splits(part_m, part_l, part_acc, base, c1, c1 < K, S, D)
    x2 = _merge_splits(part_m, part_l, part_acc, base, c2, c2 < K, S, D)
    return x1, x2


@triton.jit
def _merge_splits(part_m, part_l, part_acc, base, cols, cm, S: tl.constexpr, D: tl.constexpr):
    at = base + (cols // D) * S  # each column's head, its first split
    top = tl.full(cols.shape, -1.0e30, tl.float32)
    num = tl.zeros(cols.shape, tl.float32)
    den = tl.zeros(cols.shape, tl.float32)
    for j in tl.static_range(S):
        m = tl.load(part_m + at + j, mask=cm, other=-1.0e30, cache_modifier=".cg")
        s = tl.load(part_l + at + j, mask=cm, other=0.0, cache_modifier=".cg")
        a = tl.load(part_acc + (at + j) * D + cols % D, mask=cm, other=0.0, cache_modifier=".cg")
        new_top = tl.maximum(top, m)
        old, this = tl.exp(top - new_top), tl.exp(m - new_top)
        num = num * old + a * this
        den = den * old + s * this
        top = new_top
    return tl.where(cm, num / tl.maximum(den, 1.0e-30), 0.0)


@triton.jit
def _stream_row(h_in, embed, ids, r, layer, norm_w, eps, H, H1: tl.constexpr, H2: tl.constexpr):
    """Row r of the stream entering `layer`, normalized: at layer 0 the token's embedding row."""
    if layer == 0:
        tok = tl.load(ids + r).to(tl.int64)
        x1, x2 = _normed_row(embed + tok * H, norm_w, eps, H, H1, H2)
    else:
        x1, x2 = _normed_row(h_in + r * H, norm_w, eps, H, H1, H2)
    return x1, x2


@triton.jit
def _residual(h_in, embed, ids, r, layer, cols, cm, H):
    """Columns `cols` of row r of the stream entering `layer` (the embedding row at layer 0)."""
    if layer == 0:
        tok = tl.load(ids + r).to(tl.int64)
        res = tl.load(embed + tok * H + cols, mask=cm, other=0.0).to(tl.float32)
    else:
        res = tl.load(h_in + r * H + cols, mask=cm, other=0.0, cache_modifier=".cg")
    return res


@triton.jit
def persistent_step_kernel(
        table, n_items, counters, ids, start, slot_of, depth, row_mask, m_row, m_col,
        embed, attn_norm_w, wqkv, wo, mlp_norm_w, wgu, wd, final_norm_w, lm_head,
        cos, sin, k_cache, v_cache, c_layer, c_slot, c_head, c_pos,
        h_buf, q_buf, part_m, part_l, part_acc, act_buf, logits, tile_max, tile_arg, tokens, features, capture,
        sink, trace,
        eps, scale, L, H, I, V, n_lm_tiles,
        R: tl.constexpr, NH: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, NCAP: tl.constexpr,
        H1: tl.constexpr, H2: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, I1: tl.constexpr,
        I2: tl.constexpr, TQ: tl.constexpr, BQ: tl.constexpr, BO: tl.constexpr, BG: tl.constexpr,
        BD: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BTILES: tl.constexpr,
        PREC: tl.constexpr, PREFETCH: tl.constexpr, TRACE: tl.constexpr, ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    W = tl.num_programs(0)
    BR: tl.constexpr = 16
    REP: tl.constexpr = NH // KV
    HALF: tl.constexpr = D // 2
    QW: tl.constexpr = NH * D
    QKVW: tl.constexpr = (NH + 2 * KV) * D
    rows = tl.arange(0, BR)
    rmask = rows < R
    pos = tl.load(start).to(tl.int32)  # the step's rows go to cache positions pos..pos+R-1 of slot `slot`
    slot = tl.load(slot_of).to(tl.int64)
    for it in range(pid, n_items, W):
        e = table + it * 8
        op = tl.load(e)
        layer = tl.load(e + 1)
        part = tl.load(e + 2)
        a = tl.load(e + 3)
        b = tl.load(e + 4)
        wait = tl.load(e + 5)
        count = tl.load(e + 6)
        _stamp(trace, it, 0, TRACE)
        h_in = h_buf + 2 * layer * R * H          # h[2l]: the stream entering layer l (unused at layer 0)
        if op == 0:  # qkv: rows a..a+TQ of a fused head and their partners HALF on, rotated, to q or the cache
            wl = wqkv + layer.to(tl.int64) * QKVW * H
            lo1, lo2 = _tile(wl, H, a, a + TQ, H, BQ, H1, H2)
            hi1, hi2 = _tile(wl, H, a + HALF, a + HALF + TQ, H, BQ, H1, H2)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            c = a - part * D + tl.arange(0, BQ)   # the pair's first columns within the head
            cm = tl.arange(0, BQ) < TQ
            for r in tl.static_range(R):
                x1, x2 = _stream_row(h_in, embed, ids, r, layer, attn_norm_w + layer * H, eps, H, H1, H2)
                lo = _gemv(lo1, lo2, x1, x2)
                hi = _gemv(hi1, hi2, x1, x2)
                if part < NH + KV:  # q and k heads: rotate-half pairs column c with c + HALF
                    p = (pos + tl.load(depth + r)) * D  # the row's rotary position: a tree node's depth
                    cl = tl.load(cos + p + c, mask=cm, other=0.0)
                    sl = tl.load(sin + p + c, mask=cm, other=0.0)
                    ch = tl.load(cos + p + c + HALF, mask=cm, other=0.0)
                    sh = tl.load(sin + p + c + HALF, mask=cm, other=0.0)
                    lo, hi = lo * cl - hi * sl, hi * ch + lo * sh
                if part < NH:
                    q_dst = q_buf + layer * R * QW + r * QW + part * D
                    tl.store(q_dst + c, lo, mask=cm)
                    tl.store(q_dst + c + HALF, hi, mask=cm)
                else:
                    if part < NH + KV:
                        dst = k_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH) * c_head
                    else:
                        dst = v_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH - KV) * c_head
                    dst += (pos + r) * c_pos
                    tl.store(dst + c, lo.to(dst.dtype.element_ty), mask=cm)
                    tl.store(dst + c + HALF, hi.to(dst.dtype.element_ty), mask=cm)
        elif op == 1:  # attend: query head part // S over split part % S of the columns (the cache before pos, and
            # the new rows each row sees): the split's maximum, sum of exponentials and unnormalized output
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            head = part // S
            split = part % S
            chunk = (pos + R + S - 1) // S
            lo = tl.minimum(pos + R, split * chunk)
            hi = tl.minimum(pos + R, lo + chunk)
            g = head // REP
            kc = k_cache + layer.to(tl.int64) * c_layer + slot * c_slot + g * c_head
            vc = v_cache + layer.to(tl.int64) * c_layer + slot * c_slot + g * c_head
            dcol = tl.arange(0, D)
            m = rmask[:, None] & (dcol[None, :] < D)
            ts = tl.arange(0, BT)
            q = tl.load(q_buf + layer * R * QW + rows[:, None] * QW + head * D + dcol[None, :], mask=m, other=0.0,
                        cache_modifier=".cg")
            best = tl.full((BR,), -1.0e30, tl.float32)
            total = tl.zeros((BR,), tl.float32)
            acc = tl.zeros((BR, D), tl.float32)
            for t0 in range(lo, hi, BT):
                t = t0 + ts
                tm = t < hi
                k = tl.load(kc + t[:, None] * c_pos + dcol[None, :], mask=tm[:, None], other=0.0,
                            cache_modifier=".cg")
                v = tl.load(vc + t[:, None] * c_pos + dcol[None, :], mask=tm[:, None], other=0.0,
                            cache_modifier=".cg")
                s = tl.dot(q.to(k.dtype), tl.trans(k), out_dtype=tl.float32, input_precision=PREC) * scale
                new = t - pos  # the new rows a row sees follow row_mask
                sees = tl.load(row_mask + rows[:, None] * m_row + new[None, :] * m_col,
                               mask=rmask[:, None] & (new[None, :] >= 0) & tm[None, :], other=0)
                seen = ((t < pos) & tm)[None, :] | (sees != 0)
                s = tl.where(seen, s, -1.0e30)
                new_best = tl.maximum(best, tl.max(s, axis=1))
                pr = tl.where(seen, tl.exp(s - new_best[:, None]), 0.0)
                fade = tl.exp(best - new_best)
                total = total * fade + tl.sum(pr, axis=1)
                acc = acc * fade[:, None] + tl.dot(pr.to(v.dtype), v, out_dtype=tl.float32, input_precision=PREC)
                best = new_best
            at = (layer * R + rows) * NH * S + part  # [layer, row, head, split]
            tl.store(part_m + at, best, mask=rmask)  # -1e30 where a row sees none of the split
            tl.store(part_l + at, total, mask=rmask)
            tl.store(part_acc + at[:, None] * D + dcol[None, :], acc, mask=m)
        elif op == 2:  # o_proj tile [a, b): h[2l+1] = h[2l] + attn Wo^T
            w1, w2 = _tile(wo + layer.to(tl.int64) * H * QW, QW, a, b, QW, BO, Q1, Q2)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            cols = a + tl.arange(0, BO)
            cm = cols < b
            for r in tl.static_range(R):
                x1, x2 = _merged_attention(part_m, part_l, part_acc, (layer * R + r) * NH * S, QW, Q1, Q2, S, D)
                y = _gemv(w1, w2, x1, x2) + _residual(h_in, embed, ids, r, layer, cols, cm, H)
                tl.store(h_in + R * H + r * H + cols, y, mask=cm)
        elif op == 3:  # gate_up tile [a, b): act = silu(x Wg^T) * (x Wu^T), x = mlp_norm(h[2l+1])
            wl = wgu + layer.to(tl.int64) * 2 * I * H
            g1, g2 = _tile(wl, H, a, b, H, BG, H1, H2)
            u1, u2 = _tile(wl, H, I + a, I + b, H, BG, H1, H2)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            cols = a + tl.arange(0, BG)
            for r in tl.static_range(R):
                x1, x2 = _normed_row(h_in + R * H + r * H, mlp_norm_w + layer * H, eps, H, H1, H2)
                gate = _gemv(g1, g2, x1, x2)
                act = gate / (1.0 + tl.exp(-gate)) * _gemv(u1, u2, x1, x2)
                tl.store(act_buf + layer * R * I + r * I + cols, act, mask=cols < b)
        elif op == 4:  # down tile [a, b): h[2l+2] = h[2l+1] + act Wd^T
            w1, w2 = _tile(wd + layer.to(tl.int64) * H * I, I, a, b, I, BD, I1, I2)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            cols = a + tl.arange(0, BD)
            cm = cols < b
            for r in tl.static_range(R):
                x1, x2 = _row(act_buf + layer * R * I + r * I, I, I1, I2)
                res = tl.load(h_in + R * H + r * H + cols, mask=cm, other=0.0, cache_modifier=".cg")
                tl.store(h_in + 2 * R * H + r * H + cols, _gemv(w1, w2, x1, x2) + res, mask=cm)
            taken = tl.load(capture + layer + 1)  # bit j: feature j is the stream entering layer + 1
            if taken != 0:  # the EAGLE-3 features, in the target's dtype, from the columns just written
                tl.debug_barrier()
                rc = tl.arange(0, BR)[:, None]
                m = (rc < R) & cm[None, :]
                y = tl.load(h_in + 2 * R * H + rc * H + cols[None, :], mask=m, other=0.0, cache_modifier=".cg")
                for j in tl.static_range(NCAP):
                    if (taken >> j) & 1:
                        tl.store(features + (rc * NCAP + j) * H + cols[None, :], y.to(features.dtype.element_ty),
                                 mask=m)
        elif op == 5:  # lm_head tile [a, b) of final_norm(h[2L]), and the tile's maximum per row
            if PREFETCH:
                _touch(lm_head, H, a, b, H, sink, BL, BK)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            hl = h_buf + 2 * L * R * H
            c1 = tl.arange(0, H1)
            c2 = H1 + tl.arange(0, H2)
            m2 = rmask[:, None] & (c2[None, :] < H)
            x1 = tl.load(hl + rows[:, None] * H + c1[None, :], mask=rmask[:, None], other=0.0, cache_modifier=".cg")
            x2 = tl.load(hl + rows[:, None] * H + c2[None, :], mask=m2, other=0.0, cache_modifier=".cg")
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / H + eps)
            n1 = tl.load(final_norm_w + c1).to(tl.float32)
            n2 = tl.load(final_norm_w + c2, mask=c2 < H, other=0.0).to(tl.float32)
            x1 = (x1 * rstd[:, None] * n1[None, :]).to(lm_head.dtype.element_ty)
            x2 = (x2 * rstd[:, None] * n2[None, :]).to(lm_head.dtype.element_ty)
            best = tl.full((BR,), float("-inf"), tl.float32)
            where = tl.zeros((BR,), tl.int32)
            cn = tl.arange(0, BL)
            for n0 in range(a, b, BL):
                w1, w2 = _tile(lm_head, H, n0, b, H, BL, H1, H2)
                y = (tl.dot(x1, tl.trans(w1), out_dtype=tl.float32, input_precision=PREC)
                     + tl.dot(x2, tl.trans(w2), out_dtype=tl.float32, input_precision=PREC))
                c = n0 + cn
                y = tl.where((c < b)[None, :], y, float("-inf"))
                tl.store(logits + rows[:, None] * V + c[None, :], y, mask=rmask[:, None] & (c[None, :] < b))
                top = tl.max(y, axis=1)
                at = tl.min(tl.where(y == top[:, None], c[None, :], V), axis=1)
                better = top > best
                where = tl.where(better, at, where)
                best = tl.where(better, top, best)
            tl.store(tile_max + rows * n_lm_tiles + part, best, mask=rmask)
            tl.store(tile_arg + rows * n_lm_tiles + part, where, mask=rmask)
        else:  # argmax: the first tile holding a row's maximum holds its first index
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            tc = tl.arange(0, BTILES)
            m = rmask[:, None] & (tc[None, :] < n_lm_tiles)
            tops = tl.load(tile_max + rows[:, None] * n_lm_tiles + tc[None, :], mask=m, other=float("-inf"),
                           cache_modifier=".cg")
            ats = tl.load(tile_arg + rows[:, None] * n_lm_tiles + tc[None, :], mask=m, other=0, cache_modifier=".cg")
            top = tl.max(tops, axis=1)
            first = tl.min(tl.where(tops == top[:, None], tc[None, :], BTILES), axis=1)
            token = tl.sum(tl.where(tc[None, :] == first[:, None], ats, 0), axis=1)
            tl.store(tokens + rows, token.to(tokens.dtype.element_ty), mask=rmask)
        tl.debug_barrier()
        _stamp(trace, it, 2, TRACE)
        tl.atomic_add(counters + tl.load(e + 7), 1, sem="release")


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
