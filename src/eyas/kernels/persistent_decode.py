"""A persistent decoder step: one Triton launch runs every work item of eyas.kernels.persistent_schedule.

W programs (on a GPU the SM count, so all are co-resident) each take the schedule's items dealt round-robin
(item i to program i % W) and run them in increasing index. Items are in topological order, so the lowest
unfinished item can always run: no dealing in order deadlocks. Each item first loads its weight tile into
registers (weights never depend on the step, so the load overlaps the producers still running), then reads
its inputs, computes and writes its outputs.

What items pass each other is written as eyas.kernels.persistent_words' epoch-tagged words, which the consumer
polls until all carry this step's epoch (the epoch of the last finished step, kept on the device, plus one; the
argmax item, last of a step, stores it). With PAIRS (a bf16 target) the residual stream, the attention outputs and
the activations go two bf16 values to a word, a row's adjacent columns 2j and 2j + 1, so every wide boundary stores
and polls half the words; a consumer joins each word's values back into column order right after its poll
(persistent_blocks.awaited_rows), so the rest of its work is the same in both formats. o_proj and down round their
input rows to bf16 anyway; the stream rounded to bf16 at each write is what the model's own bf16 path does. Every
such buffer is written once per step (the residual stream has one slice per stage: h[2l+1] after layer l's
attention, h[2l+2] after its MLP; layer 0 reads the embedding rows directly), so there are no write-after-read
hazards between items. The step's own key and value rows go to the cache (in its dtype, for later steps) and, as
words, to kv_new for this step's attention; the cache's older rows were written by earlier launches. Each item also
bumps its schedule counter (relaxed; nobody waits on it), so the tests can check every counter ends at the number
of items that signal it.

Every projection, the LM head's included, is a tensor-core product of the step's rows (BR: R padded to a
power of two) and the item's weight tile, its columns cut into chunks of CHUNK: one product per chunk, the
warps split the chunks, and the chunks' results are summed. (Over all 576 columns at once, every warp
would hold all the rows' columns, since the warps split only a product's outputs: that spills. A row at a
time on the CUDA cores costs a cross-warp reduction per row.) The rows are rounded to the weights' dtype
first, as a dense layer's input is; an fp32 target multiplies in full fp32. Activations are fp32 (but see
PAIRS); weights stay in the target's dtype.

With DRAFT the step is an EAGLE-3 draft's (L = 1, eyas.models.eagle3's midlayer): a qkv item reads the target's
embedding of the draft ids (id + d2t[id]) normed by the layer's input norm and the hidden input normed by
hidden_norm, as two products over the 2H-wide weight rows; o_proj's residual is the hidden input; the down items
write the layer's output to `features` (the next step's hidden input), and the LM head covers the draft
vocabulary. Its inputs were written before the launch: its qkv items poll nothing.

In a traced step each item records three %globaltimer stamps (start, inputs arrived, done), from which
eyas.kernels.persistent_trace tells where the step's time went. In Triton's interpreter (CPU tests) the
programs of a grid run one after another, so a poll on another program's output would never end: CPU
callers launch with W=1. eyas.kernels.persistent_step owns the launch, its tables and buffers.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from eyas.kernels.persistent_blocks import (awaited_rows, embedding_tile, halves, norm_weights, normed, normed_pair,
                                           plain_rows, product, product_pair, settled_tile, store_tile, stream_rows,
                                           token_rows, weight_tile, weight_tile_pair)
from eyas.kernels.persistent_words import await_both, await_three, pack, packed

CHUNK = 128  # columns per chunk of a product: each chunk is one tensor-core product, the warps split the chunks
NEW_ROWS = tl.constexpr(16)  # kv_new's rows per kv head: a step's rows, padded to a tensor-core product's depth
OPS = ("qkv", "attend", "o_proj", "gate_up", "down", "lm_head", "argmax")  # the op codes of the item table


def split_pow2(k: int) -> tuple[int, int]:
    """Two power-of-two block widths that cover k columns (576 -> 512 + 64, 1536 -> 1024 + 512): a row or
    a weight tile is held as two register blocks, the second masked past k."""
    first = 1 << (k.bit_length() - 1)
    if first == k:
        first //= 2
    return first, triton.next_power_of_2(k - first)

@triton.jit
def _stamp(trace, it, k, TRACE: tl.constexpr):
    if TRACE:
        tl.store(trace + it * 3 + k, globaltimer())


@triton.jit
def persistent_step_kernel(
        table, n_items, counters, epoch, ids, start, slot_of, depth, row_mask, m_row, m_col,
        embed, d2t, hidden_in, hidden_norm_w, attn_norm_w, wqkv, wo, mlp_norm_w, wgu, wd, final_norm_w, lm_head,
        cos, sin, k_cache, v_cache, c_layer, c_slot, c_head, c_pos,
        h_buf, q_buf, kv_new, attn_buf, act_buf, logits, tile_max, tile_arg, tokens, features,
        capture, trace,
        eps, scale, L, H, I, V, n_lm_tiles,
        R: tl.constexpr, BR: tl.constexpr, NH: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, NCAP: tl.constexpr,
        H1: tl.constexpr, H2: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, I1: tl.constexpr,
        I2: tl.constexpr, TQ: tl.constexpr, BQ: tl.constexpr, BO: tl.constexpr, BG: tl.constexpr,
        BD: tl.constexpr, HC: tl.constexpr, QC: tl.constexpr, IC: tl.constexpr, BL: tl.constexpr,
        BT: tl.constexpr, BTILES: tl.constexpr, PAIRS: tl.constexpr, PREC: tl.constexpr,
        NAP: tl.constexpr, TRACE: tl.constexpr, DRAFT: tl.constexpr):
    pid = tl.program_id(0)
    W = tl.num_programs(0)
    REP: tl.constexpr = NH // KV
    HALF: tl.constexpr = D // 2
    QW: tl.constexpr = NH * D
    QKVW: tl.constexpr = (NH + 2 * KV) * D
    QS: tl.constexpr = QW // 2 if PAIRS else QW  # the words of an attention row
    if PAIRS:  # the words of a stream row and of an activation row
        HS = H // 2
        AW = I // 2
    else:
        HS = H
        AW = I
    rows = tl.arange(0, BR)
    rmask = rows < R
    dcol = tl.arange(0, D)
    pos = tl.load(start).to(tl.int32)  # the step's rows go to cache positions pos..pos+R-1 of slot `slot`
    slot = tl.load(slot_of).to(tl.int64)
    ep = tl.load(epoch) + 1  # this step's epoch: every word written this step carries it (the argmax item stores it)
    for it in range(pid, n_items, W):
        e = table + it * 8
        op = tl.load(e)
        layer = tl.load(e + 1)
        part = tl.load(e + 2)
        a = tl.load(e + 3)
        b = tl.load(e + 4)
        _stamp(trace, it, 0, TRACE)
        h_in = h_buf + 2 * layer * R * HS         # h[2l]: the stream entering layer l (unused at layer 0)
        if op == 0:  # qkv: rows a..a+TQ of a fused head and their partners HALF on, rotated, to q or the cache
            if DRAFT:  # the midlayer's q/k/v read [input_norm(embedding), hidden_norm(hidden)]: 2H columns
                lh1, lh2 = weight_tile_pair(wqkv, 2 * H, a, a + HALF, TQ, H, BQ, H1, H2, HC)
                lg1, lg2 = weight_tile_pair(wqkv + H, 2 * H, a, a + HALF, TQ, H, BQ, H1, H2, HC)
                ng1, ng2 = norm_weights(hidden_norm_w, H, H1, H2, HC)
            else:
                wl = wqkv + layer.to(tl.int64) * QKVW * H
                lh1, lh2 = weight_tile_pair(wl, H, a, a + HALF, TQ, H, BQ, H1, H2, HC)
            nw1, nw2 = norm_weights(attn_norm_w + layer * H, H, H1, H2, HC)
            c = a - part * D + tl.arange(0, BQ)   # the pair's first columns within the head
            cm = tl.arange(0, BQ) < TQ
            m = rmask[:, None] & cm[None, :]
            # q and k heads are rotated (rotate-half pairs column c with c + HALF): their cos and sin are loaded
            # before the poll, so the loads overlap the wait
            rm = m & (tl.zeros_like(c) + part < NH + KV)[None, :]
            p = ((pos + tl.load(depth + rows, mask=rmask, other=0)) * D)[:, None]  # a tree node's depth
            cl = tl.load(cos + p + c[None, :], mask=rm, other=0.0)
            sl = tl.load(sin + p + c[None, :], mask=rm, other=0.0)
            ch = tl.load(cos + p + HALF + c[None, :], mask=rm, other=0.0)
            sh = tl.load(sin + p + HALF + c[None, :], mask=rm, other=0.0)
            if DRAFT:  # both inputs were written before the launch: nothing to poll
                x1, x2, g1, g2 = normed_pair(*token_rows(embed, d2t, ids, rows, rmask, H, H1, H2, HC, DRAFT), nw1, nw2,
                                             *plain_rows(hidden_in, rows * H, rmask, H, H1, H2, HC), ng1, ng2, eps, H)
                _stamp(trace, it, 1, TRACE)
                y = product_pair(x1, x2, lh1, lh2, g1, g2, lg1, lg2, PREC)
            else:
                x1, x2 = stream_rows(h_in, embed, ids, rows, rmask, layer, nw1, nw2, eps, H, H1, H2, HC, ep, NAP,
                                     PAIRS)
                _stamp(trace, it, 1, TRACE)
                y = product(x1, x2, lh1, lh2, PREC)
            lo, hi = halves(y, BR, 2 * BQ)
            if part < NH + KV:
                lo, hi = lo * cl - hi * sl, hi * ch + lo * sh
            both = tl.join(lo, hi)  # [BR, BQ, 2]: the pair's halves, stored at once (_store_halves)
            if part < NH:
                q_dst = q_buf + layer * R * QW + rows[:, None] * QW + part * D + c[None, :]
                _store_halves(q_dst, packed(both, ep), m, HALF)
            else:  # k or v: to the cache for later steps, and (as the cache rounds it) to kv_new for this one
                if part < NH + KV:
                    dst = k_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH) * c_head
                else:
                    dst = v_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH - KV) * c_head
                dst = dst + (pos + rows[:, None]) * c_pos + c[None, :]
                kv = both.to(dst.dtype.element_ty)
                _store_halves(dst, kv, m, HALF)
                new_dst = kv_new + ((layer * 2 * KV + part - NH) * NEW_ROWS + rows[:, None]) * D + c[None, :]
                _store_halves(new_dst, packed(kv.to(tl.float32), ep), m, HALF)
        elif op == 1:  # attend: query head `part` over the cache's columns before pos, then over the new rows each
            # row sees; its normalized output, to attn
            g = part // REP
            m = rmask[:, None] & (dcol[None, :] < D)
            j = tl.arange(0, NEW_ROWS)  # the new rows, from kv_new: row r sees new row j where row_mask[r, j]
            jm = (j < R)[:, None] & (dcol[None, :] < D)
            at = ((layer * 2 * KV + g) * NEW_ROWS + j[:, None]) * D + dcol[None, :]
            kc = k_cache + layer.to(tl.int64) * c_layer + slot * c_slot + g * c_head
            vc = v_cache + layer.to(tl.int64) * c_layer + slot * c_slot + g * c_head
            k, v, tm = _cache_block(kc, vc, 0, pos, c_pos, BT, D)  # the cache, written by earlier steps, before the poll
            q_at = q_buf + layer * R * QW + rows[:, None] * QW + part * D + dcol[None, :]
            if R == 1:  # the row sees one new row, itself: its score and value start the running softmax, which
                # spares a product, two cross-warp reductions and three trips through shared memory
                own = kv_new + ((layer * 2 * KV + g) * NEW_ROWS + rows[:, None]) * D + dcol[None, :]
                q, k_new, v_new = await_three(q_at, m, own, m, own + KV * NEW_ROWS * D, m, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                q = q.to(k_cache.dtype.element_ty)
                best = tl.sum(q.to(tl.float32) * k_new, axis=1) * scale
                total = tl.full((BR,), 1.0, tl.float32)
                acc = v_new
            else:
                # the tree mask does not depend on this step's words: loaded before the poll
                sees = tl.load(row_mask + rows[:, None] * m_row + j[None, :] * m_col,
                               mask=rmask[:, None] & (j < R)[None, :], other=0)
                q, k_new, v_new = await_three(q_at, m, kv_new + at, jm, kv_new + at + KV * NEW_ROWS * D, jm, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                q = q.to(k_cache.dtype.element_ty)
                best = tl.full((BR,), -1.0e30, tl.float32)
                total = tl.zeros((BR,), tl.float32)
                acc = tl.zeros((BR, D), tl.float32)
            for t0 in range(0, pos, BT):  # the next block's loads in flight while this one is folded in
                k_next, v_next, tm_next = _cache_block(kc, vc, t0 + BT, pos, c_pos, BT, D)
                best, total, acc = _fold_cache_block(q, k, v, tm, scale, best, total, acc, PREC)
                k, v, tm = k_next, v_next, tm_next
            if R > 1:  # the new rows each row sees
                s = tl.dot(q, tl.trans(k_new.to(k_cache.dtype.element_ty)), out_dtype=tl.float32,
                           input_precision=PREC)
                s = tl.where(sees != 0, s * scale, -1.0e30)
                best, total, acc = _online_softmax(s, v_new.to(v_cache.dtype.element_ty), best, total, acc, PREC)
            out = acc / tl.maximum(total, 1.0e-30)[:, None]
            store_tile(attn_buf + layer * R * QS, rows, rmask, part * D, part * D + D, QW, out, ep, BR, D, PAIRS)
        elif op == 2:  # o_proj tile [a, b): h[2l+1] = h[2l] + attn Wo^T
            w1, w2 = weight_tile(wo + layer.to(tl.int64) * H * QW, QW, a, b, QW, BO, Q1, Q2, QC)
            if layer == 0:  # the residual is the tokens' embedding rows, or a draft midlayer's hidden input
                cols = a + tl.arange(0, BO)
                m = rmask[:, None] & (cols < b)[None, :]
                if DRAFT:
                    res = tl.load(hidden_in + rows[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
                else:
                    res = embedding_tile(embed, ids, rows, rmask, cols, m, H)
                x1, x2 = awaited_rows(attn_buf, rows, rmask, QW, Q1, Q2, QC, ep, NAP, PAIRS)
            else:
                x1, x2 = awaited_rows(attn_buf + layer * R * QS, rows, rmask, QW, Q1, Q2, QC, ep, NAP, PAIRS)
                res = settled_tile(h_in, rows, rmask, a, b, H, ep, BO, PAIRS)
            _stamp(trace, it, 1, TRACE)
            y = product(x1, x2, w1, w2, PREC) + res
            store_tile(h_in + R * HS, rows, rmask, a, b, H, y, ep, BR, BO, PAIRS)
        elif op == 3:  # gate_up tile [a, b): act = silu(x Wg^T) * (x Wu^T), x = mlp_norm(h[2l+1])
            gu1, gu2 = weight_tile_pair(wgu + layer.to(tl.int64) * 2 * I * H, H, a, I + a, b - a, H, BG, H1, H2, HC)
            nw1, nw2 = norm_weights(mlp_norm_w + layer * H, H, H1, H2, HC)
            x1, x2 = awaited_rows(h_in + R * HS, rows, rmask, H, H1, H2, HC, ep, NAP, PAIRS)
            _stamp(trace, it, 1, TRACE)
            x1, x2 = normed(x1, x2, nw1, nw2, eps, H)
            gate, up = halves(product(x1, x2, gu1, gu2, PREC), BR, 2 * BG)
            act = gate / (1.0 + tl.exp(-gate)) * up
            store_tile(act_buf + layer * R * AW, rows, rmask, a, b, I, act, ep, BR, BG, PAIRS)
        elif op == 4:  # down tile [a, b): h[2l+2] = h[2l+1] + act Wd^T
            w1, w2 = weight_tile(wd + layer.to(tl.int64) * H * I, I, a, b, I, BD, I1, I2, IC)
            taken = tl.load(capture + layer + 1)  # bit j: feature j is the stream entering layer + 1
            x1, x2 = awaited_rows(act_buf + layer * R * AW, rows, rmask, I, I1, I2, IC, ep, NAP, PAIRS)
            res = settled_tile(h_in + R * HS, rows, rmask, a, b, H, ep, BD, PAIRS)
            _stamp(trace, it, 1, TRACE)
            y = product(x1, x2, w1, w2, PREC) + res
            store_tile(h_in + 2 * R * HS, rows, rmask, a, b, H, y, ep, BR, BD, PAIRS)
            cols = a + tl.arange(0, BD)
            for j in tl.static_range(NCAP):  # the EAGLE-3 features, in the target's dtype
                if (taken >> j) & 1:
                    tl.store(features + (rows[:, None] * NCAP + j) * H + cols[None, :],
                             y.to(features.dtype.element_ty), mask=rmask[:, None] & (cols < b)[None, :])
        elif op == 5:  # lm_head tile [a, b) of final_norm(h[2L]), and the tile's maximum per row
            nw1, nw2 = norm_weights(final_norm_w, H, H1, H2, HC)
            x1, x2 = awaited_rows(h_buf + 2 * L * R * HS, rows, rmask, H, H1, H2, HC, ep, NAP, PAIRS)
            _stamp(trace, it, 1, TRACE)
            x1, x2 = normed(x1, x2, nw1, nw2, eps, H)
            best = tl.full((BR,), float("-inf"), tl.float32)
            where = tl.zeros((BR,), tl.int32)
            cn = tl.arange(0, BL)
            for n0 in range(a, b, BL):
                w1, w2 = weight_tile(lm_head, H, n0, b, H, BL, H1, H2, HC)
                y = product(x1, x2, w1, w2, PREC)
                c = n0 + cn
                y = tl.where((c < b)[None, :], y, float("-inf"))
                tl.store(logits + rows[:, None] * V + c[None, :], y, mask=rmask[:, None] & (c[None, :] < b))
                top = tl.max(y, axis=1)
                at = tl.min(tl.where(y == top[:, None], c[None, :], V), axis=1)
                better = top > best
                where = tl.where(better, at, where)
                best = tl.where(better, top, best)
            tl.store(tile_max + rows * n_lm_tiles + part, packed(best, ep), mask=rmask)
            tl.store(tile_arg + rows * n_lm_tiles + part, pack(where, ep), mask=rmask)
        else:  # argmax: the first tile holding a row's maximum holds its first index; then the step's epoch
            tc = tl.arange(0, BTILES)
            m = rmask[:, None] & (tc[None, :] < n_lm_tiles)
            at = rows[:, None] * n_lm_tiles + tc[None, :]
            tops, ats = await_both(tile_max + at, m, tile_arg + at, m, ep, NAP)
            tops = tl.where(m, tops, float("-inf"))
            ats = ats.to(tl.int32, bitcast=True)
            _stamp(trace, it, 1, TRACE)
            top = tl.max(tops, axis=1)
            first = tl.min(tl.where(tops == top[:, None], tc[None, :], BTILES), axis=1)
            token = tl.sum(tl.where(tc[None, :] == first[:, None], ats, 0), axis=1)
            tl.store(tokens + rows, token.to(tokens.dtype.element_ty), mask=rmask)
            tl.store(epoch, ep)
        _stamp(trace, it, 2, TRACE)
        tl.atomic_add(counters + tl.load(e + 7), 1, sem="relaxed")  # completion accounting; nobody waits on it


@triton.jit
def _store_halves(dst, both, mask, HALF: tl.constexpr):
    """A rotation pair's halves (both [BR, BQ, 2]) at dst and dst + HALF ([BR, BQ] each) in one store: one trip
    to the store's layout through shared memory instead of two."""
    s = tl.arange(0, 2)[None, None, :]
    tl.store(dst[:, :, None] + s * HALF, both, mask=mask[:, :, None] & (s < 2))


@triton.jit
def _cache_block(kc, vc, t0, pos, c_pos, BT: tl.constexpr, D: tl.constexpr):
    """Cache columns t0..t0+BT of one kv head (keys, values [BT, D]) and which of them lie before pos."""
    t = t0 + tl.arange(0, BT)
    tm = (t < pos)[:, None]
    d = tl.arange(0, D)[None, :]
    k = tl.load(kc + t[:, None] * c_pos + d, mask=tm, other=0.0)
    v = tl.load(vc + t[:, None] * c_pos + d, mask=tm, other=0.0)
    return k, v, tm


@triton.jit
def _fold_cache_block(q, k, v, tm, scale, best, total, acc, PREC: tl.constexpr):
    """_cache_block's columns folded into the rows' running softmax (columns past pos are not seen)."""
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PREC) * scale
    s = tl.where(tl.trans(tm), s, -1.0e30)
    return _online_softmax(s, v, best, total, acc, PREC)


@triton.jit
def _online_softmax(s, v, best, total, acc, PREC: tl.constexpr):
    """One block of attention scores s [BR, T] (-1e30 where not seen) and values v [T, D] folded into the running
    maximum, sum of exponentials and unnormalized output of each row."""
    new_best = tl.maximum(best, tl.max(s, axis=1))
    pr = tl.where(s > -1.0e29, tl.exp(s - new_best[:, None]), 0.0)
    fade = tl.exp(best - new_best)
    total = total * fade + tl.sum(pr, axis=1)
    acc = acc * fade[:, None] + tl.dot(pr.to(v.dtype), v, out_dtype=tl.float32, input_precision=PREC)
    return new_best, total, acc
