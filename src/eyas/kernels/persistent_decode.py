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

Every projection, the LM head's included, is a tensor-core product of the step's rows (padded to 16)
and the item's weight tile, its columns cut into chunks of CHUNK: one product per chunk, the warps split
the chunks, and the chunks' results are summed. (Over all 576 columns at once, every warp would hold all
the rows' columns, since the warps split only a product's outputs: that spills. A row at a time on the
CUDA cores costs a cross-warp reduction per row.) The rows are rounded to the weights' dtype first, as a
dense layer's input is; an fp32 target multiplies in full fp32.

Every buffer is written once per step (the residual stream has one slice per stage: h[2l+1] after layer
l's attention, h[2l+2] after its MLP; layer 0 reads the embedding rows directly), so there are no
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

CHUNK = 128  # columns per chunk of a product: each chunk is one tensor-core product, the warps split the chunks
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
def _chunks(K1: tl.constexpr, KC: tl.constexpr, first):
    """Column offsets [K1 // KC, 1, KC] of a block of K1 columns starting at `first`, cut into chunks of KC."""
    return first + tl.arange(0, K1 // KC)[:, None, None] * KC + tl.arange(0, KC)[None, None, :]


@triton.jit
def _tile(w, stride, n0, n_end, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Weight rows n0..n_end of W [*, K] (rows past n_end are 0) as two register blocks [K1 // KC, BN, KC],
    [K2 // KC, BN, KC]: columns cut into chunks of KC, so that a product splits its sum over the chunks."""
    n = (n0 + tl.arange(0, BN))[None, :, None]
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    w1 = tl.load(w + n * stride + c1, mask=n < n_end, other=0.0)
    w2 = tl.load(w + n * stride + c2, mask=(n < n_end) & (c2 < K), other=0.0)
    return w1, w2


@triton.jit
def _rows(src, offs, rm, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Rows src[offs[i] : offs[i] + K] (written by other programs, read through L2) in fp32 as blocks
    [K1 // KC, BR, KC], [K2 // KC, BR, KC]; rows outside `rm` are 0."""
    at = offs[None, :, None]
    m = rm[None, :, None]
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    x1 = tl.load(src + at + c1, mask=m, other=0.0, cache_modifier=".cg")
    x2 = tl.load(src + at + c2, mask=m & (c2 < K), other=0.0, cache_modifier=".cg")
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _normed(x1, x2, norm_w, eps, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """rmsnorm of each row of _rows' blocks, times norm_w."""
    total = tl.sum(tl.sum(x1 * x1, axis=2), axis=0) + tl.sum(tl.sum(x2 * x2, axis=2), axis=0)
    rstd = (1.0 / tl.sqrt(total / K + eps))[None, :, None]
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    w1 = tl.load(norm_w + c1).to(tl.float32)
    w2 = tl.load(norm_w + c2, mask=c2 < K, other=0.0).to(tl.float32)
    return x1 * rstd * w1, x2 * rstd * w2


@triton.jit
def _product(x1, x2, w1, w2, PREC: tl.constexpr):
    """[BR, BN] fp32: rows (_rows' blocks) times a weight tile (_tile's blocks) on the tensor cores, one
    product per chunk of columns (so the warps split the sum), then summed over the chunks. The rows are
    rounded to the weights' dtype, as a dense layer's input is; fp32 weights multiply in full fp32 (PREC
    "ieee")."""
    y1 = tl.dot(x1.to(w1.dtype), tl.permute(w1, (0, 2, 1)), out_dtype=tl.float32, input_precision=PREC)
    y2 = tl.dot(x2.to(w2.dtype), tl.permute(w2, (0, 2, 1)), out_dtype=tl.float32, input_precision=PREC)
    return tl.sum(y1, axis=0) + tl.sum(y2, axis=0)


@triton.jit
def _merged_attention(part_m, part_l, part_acc, base, R: tl.constexpr, BR: tl.constexpr, K, K1: tl.constexpr,
                      K2: tl.constexpr, KC: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
    """The step's attention output [BR, K = heads * D] as _rows' blocks: for each row r, each head's S splits
    (their maxima, sums and unnormalized outputs from base + r * heads * S, the row's first (head, split))
    merged in split order. Merged one row at a time, which keeps a row's split values at one register block
    each."""
    rows = tl.arange(0, BR)[None, :, None]
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    x1 = tl.zeros((K1 // KC, BR, KC), tl.float32)
    x2 = tl.zeros((K2 // KC, BR, KC), tl.float32)
    for r in tl.static_range(R):
        at = base + r * (K // D) * S
        x1 = tl.where(rows == r, _merge_splits(part_m, part_l, part_acc, at, c1, c1 < K, S, D), x1)
        x2 = tl.where(rows == r, _merge_splits(part_m, part_l, part_acc, at, c2, c2 < K, S, D), x2)
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
def _stream_rows(h_in, embed, ids, rows, rm, layer, norm_w, eps, H, H1: tl.constexpr, H2: tl.constexpr,
                 HC: tl.constexpr):
    """The step's rows of the stream entering `layer`, normalized: at layer 0 the tokens' embedding rows."""
    if layer == 0:
        x1, x2 = _rows(embed, tl.load(ids + rows, mask=rm, other=0).to(tl.int64) * H, rm, H, H1, H2, HC)
    else:
        x1, x2 = _rows(h_in, rows * H, rm, H, H1, H2, HC)
    return _normed(x1, x2, norm_w, eps, H, H1, H2, HC)


@triton.jit
def _residual(h_in, embed, ids, rows, rm, layer, cols, cm, H):
    """Columns `cols` of the step's rows of the stream entering `layer` (the embedding rows at layer 0)."""
    m = rm[:, None] & cm[None, :]
    if layer == 0:
        tok = tl.load(ids + rows, mask=rm, other=0).to(tl.int64)
        res = tl.load(embed + tok[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        res = tl.load(h_in + rows[:, None] * H + cols[None, :], mask=m, other=0.0, cache_modifier=".cg")
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
        BD: tl.constexpr, HC: tl.constexpr, QC: tl.constexpr, IC: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BTILES: tl.constexpr,
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
            lo1, lo2 = _tile(wl, H, a, a + TQ, H, BQ, H1, H2, HC)
            hi1, hi2 = _tile(wl, H, a + HALF, a + HALF + TQ, H, BQ, H1, H2, HC)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            c = a - part * D + tl.arange(0, BQ)   # the pair's first columns within the head
            cm = tl.arange(0, BQ) < TQ
            m = rmask[:, None] & cm[None, :]
            x1, x2 = _stream_rows(h_in, embed, ids, rows, rmask, layer, attn_norm_w + layer * H, eps, H, H1, H2, HC)
            lo = _product(x1, x2, lo1, lo2, PREC)
            hi = _product(x1, x2, hi1, hi2, PREC)
            if part < NH + KV:  # q and k heads: rotate-half pairs column c with c + HALF
                p = ((pos + tl.load(depth + rows, mask=rmask, other=0)) * D)[:, None]  # a tree node's depth
                cl = tl.load(cos + p + c[None, :], mask=m, other=0.0)
                sl = tl.load(sin + p + c[None, :], mask=m, other=0.0)
                ch = tl.load(cos + p + HALF + c[None, :], mask=m, other=0.0)
                sh = tl.load(sin + p + HALF + c[None, :], mask=m, other=0.0)
                lo, hi = lo * cl - hi * sl, hi * ch + lo * sh
            if part < NH:
                q_dst = q_buf + layer * R * QW + rows[:, None] * QW + part * D + c[None, :]
                tl.store(q_dst, lo, mask=m)
                tl.store(q_dst + HALF, hi, mask=m)
            else:
                if part < NH + KV:
                    dst = k_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH) * c_head
                else:
                    dst = v_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH - KV) * c_head
                dst = dst + (pos + rows[:, None]) * c_pos + c[None, :]
                tl.store(dst, lo.to(dst.dtype.element_ty), mask=m)
                tl.store(dst + HALF, hi.to(dst.dtype.element_ty), mask=m)
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
            w1, w2 = _tile(wo + layer.to(tl.int64) * H * QW, QW, a, b, QW, BO, Q1, Q2, QC)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            cols = a + tl.arange(0, BO)
            cm = cols < b
            x1, x2 = _merged_attention(part_m, part_l, part_acc, layer * R * NH * S, R, BR, QW, Q1, Q2, QC, S, D)
            y = _product(x1, x2, w1, w2, PREC) + _residual(h_in, embed, ids, rows, rmask, layer, cols, cm, H)
            tl.store(h_in + R * H + rows[:, None] * H + cols[None, :], y, mask=rmask[:, None] & cm[None, :])
        elif op == 3:  # gate_up tile [a, b): act = silu(x Wg^T) * (x Wu^T), x = mlp_norm(h[2l+1])
            wl = wgu + layer.to(tl.int64) * 2 * I * H
            g1, g2 = _tile(wl, H, a, b, H, BG, H1, H2, HC)
            u1, u2 = _tile(wl, H, I + a, I + b, H, BG, H1, H2, HC)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            cols = a + tl.arange(0, BG)
            x1, x2 = _rows(h_in + R * H, rows * H, rmask, H, H1, H2, HC)
            x1, x2 = _normed(x1, x2, mlp_norm_w + layer * H, eps, H, H1, H2, HC)
            gate = _product(x1, x2, g1, g2, PREC)
            act = gate / (1.0 + tl.exp(-gate)) * _product(x1, x2, u1, u2, PREC)
            tl.store(act_buf + layer * R * I + rows[:, None] * I + cols[None, :], act,
                     mask=rmask[:, None] & (cols < b)[None, :])
        elif op == 4:  # down tile [a, b): h[2l+2] = h[2l+1] + act Wd^T
            w1, w2 = _tile(wd + layer.to(tl.int64) * H * I, I, a, b, I, BD, I1, I2, IC)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            cols = a + tl.arange(0, BD)
            m = rmask[:, None] & (cols < b)[None, :]
            x1, x2 = _rows(act_buf + layer * R * I, rows * I, rmask, I, I1, I2, IC)
            res = tl.load(h_in + R * H + rows[:, None] * H + cols[None, :], mask=m, other=0.0, cache_modifier=".cg")
            y = _product(x1, x2, w1, w2, PREC) + res
            tl.store(h_in + 2 * R * H + rows[:, None] * H + cols[None, :], y, mask=m)
            taken = tl.load(capture + layer + 1)  # bit j: feature j is the stream entering layer + 1
            for j in tl.static_range(NCAP):  # the EAGLE-3 features, in the target's dtype
                if (taken >> j) & 1:
                    tl.store(features + (rows[:, None] * NCAP + j) * H + cols[None, :],
                             y.to(features.dtype.element_ty), mask=m)
        elif op == 5:  # lm_head tile [a, b) of final_norm(h[2L]), and the tile's maximum per row
            if PREFETCH:
                _touch(lm_head, H, a, b, H, sink, BL, BK)
            _wait(counters, wait, count, ON_GPU)
            _stamp(trace, it, 1, TRACE)
            x1, x2 = _rows(h_buf + 2 * L * R * H, rows * H, rmask, H, H1, H2, HC)
            x1, x2 = _normed(x1, x2, final_norm_w, eps, H, H1, H2, HC)
            best = tl.full((BR,), float("-inf"), tl.float32)
            where = tl.zeros((BR,), tl.int32)
            cn = tl.arange(0, BL)
            for n0 in range(a, b, BL):
                w1, w2 = _tile(lm_head, H, n0, b, H, BL, H1, H2, HC)
                y = _product(x1, x2, w1, w2, PREC)
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
