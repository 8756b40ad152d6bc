"""A persistent decoder step: one Triton launch runs every work item of eyas.kernels.persistent_schedule.

W programs (on a GPU the SM count, so all are co-resident) each take the schedule's items dealt round-robin
(item i to program i % W) and run them in increasing index. Items are in topological order, so the lowest
unfinished item can always run: no dealing in order deadlocks. Each item first loads its weight tile into
registers (weights never depend on the step, so the load overlaps the producers still running), then reads
its inputs, computes and writes its outputs.

What items pass each other is written as eyas.kernels.persistent_words' epoch-tagged words, which the consumer
polls until all carry this step's epoch (the epoch of the last finished step, kept on the device, plus one; the
argmax item, last of a step, stores it). With PAIRS (a bf16 target) the residual stream, the attention outputs
and the activations go two bf16 values to a word, so every wide boundary stores and polls half the words: a
producer of G columns (an attention head, a projection's tile) pairs its column j with j + G / 2, and a
consumer loads its weight columns in that order (pair_weight_tile). o_proj and down round their input rows to bf16
anyway; the stream rounded to bf16 at each write is what the model's own bf16 path does. Every such buffer is
written once per step (the residual stream has one slice per stage: h[2l+1] after layer l's attention, h[2l+2]
after its MLP; layer 0 reads the embedding rows directly), so there are no write-after-read hazards between
items. The step's own key and value rows go to the cache (in its dtype, for later steps) and, as words, to
kv_new for this step's attention; the cache's older rows were written by earlier launches. Each item also bumps
its schedule counter (relaxed; nobody waits on it), so the tests can check every counter ends at the number of
items that signal it.

Every projection, the LM head's included, is a tensor-core product of the step's rows (BR: R padded to a
power of two) and the item's weight tile, its columns cut into chunks of CHUNK: one product per chunk, the
warps split the chunks, and the chunks' results are summed. (Over all 576 columns at once, every warp
would hold all the rows' columns, since the warps split only a product's outputs: that spills. A row at a
time on the CUDA cores costs a cross-warp reduction per row.) The rows are rounded to the weights' dtype
first, as a dense layer's input is; an fp32 target multiplies in full fp32. Activations are fp32 (but see
PAIRS); weights stay in the target's dtype.

In a traced step each item records three %globaltimer stamps (start, inputs arrived, done), from which
eyas.kernels.persistent_trace tells where the step's time went. In Triton's interpreter (CPU tests) the
programs of a grid run one after another, so a poll on another program's output would never end: CPU
callers launch with W=1. eyas.kernels.persistent_step owns the launch, its tables and buffers.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from eyas.kernels.persistent_blocks import (awaited_pair_rows, awaited_rows, embedding_tile, halves, norm_weights,
                                           normed, pair_norm_weights, pair_normed, pair_stream_rows,
                                           pair_tile_product, pair_weight_tile, pair_weight_tile_pair, pairs_product,
                                           product, store_pairs, stream_rows, weight_tile, weight_tile_pair)
from eyas.kernels.persistent_words import (await_both, await_three, pack, pack_pair, packed, pair_values, settled,
                                          settled_words)

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
        embed, attn_norm_w, wqkv, wo, mlp_norm_w, wgu, wd, final_norm_w, lm_head,
        cos, sin, k_cache, v_cache, c_layer, c_slot, c_head, c_pos,
        h_buf, q_buf, kv_new, attn_buf, act_buf, logits, tile_max, tile_arg, tokens, features,
        capture, trace,
        eps, scale, L, H, I, V, n_lm_tiles,
        R: tl.constexpr, BR: tl.constexpr, NH: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, NCAP: tl.constexpr,
        H1: tl.constexpr, H2: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, I1: tl.constexpr,
        I2: tl.constexpr, TQ: tl.constexpr, BQ: tl.constexpr, BO: tl.constexpr, BG: tl.constexpr,
        BD: tl.constexpr, HC: tl.constexpr, QC: tl.constexpr, IC: tl.constexpr, BL: tl.constexpr,
        BT: tl.constexpr, BTILES: tl.constexpr, PAIRS: tl.constexpr, HP1: tl.constexpr, HP2: tl.constexpr,
        HPC: tl.constexpr, QP1: tl.constexpr, QP2: tl.constexpr, QPC: tl.constexpr, IP1: tl.constexpr,
        IP2: tl.constexpr, IPC: tl.constexpr, PREC: tl.constexpr,
        NAP: tl.constexpr, TRACE: tl.constexpr):
    pid = tl.program_id(0)
    W = tl.num_programs(0)
    REP: tl.constexpr = NH // KV
    HALF: tl.constexpr = D // 2
    QW: tl.constexpr = NH * D
    QKVW: tl.constexpr = (NH + 2 * KV) * D
    QW2: tl.constexpr = QW // 2
    GR: tl.constexpr = BD // 2  # with PAIRS, o_proj and down tiles are both BD columns (PersistentStep checks)
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
            wl = wqkv + layer.to(tl.int64) * QKVW * H
            if PAIRS:  # the stream as pairs from down tiles of BD columns
                lhl1, lhl2 = pair_weight_tile_pair(wl, H, a, a + HALF, TQ, HS, BQ, HP1, HP2, HPC, GR, 0)
                lhh1, lhh2 = pair_weight_tile_pair(wl, H, a, a + HALF, TQ, HS, BQ, HP1, HP2, HPC, GR, 1)
                nl1, nl2, nh1, nh2 = pair_norm_weights(attn_norm_w + layer * H, HS, HP1, HP2, HPC, GR)
            else:
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
            if PAIRS:
                l1, l2, h1, h2 = pair_stream_rows(h_in, embed, ids, rows, rmask, layer, nl1, nl2, nh1, nh2, eps, H,
                                                   HS, HP1, HP2, HPC, GR, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                lo, hi = halves(pairs_product(l1, l2, h1, h2, lhl1, lhl2, lhh1, lhh2, PREC), BR, 2 * BQ)
            else:
                x1, x2 = stream_rows(h_in, embed, ids, rows, rmask, layer, nw1, nw2, eps, H, H1, H2, HC, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                lo, hi = halves(product(x1, x2, lh1, lh2, PREC), BR, 2 * BQ)
            if part < NH + KV:
                lo, hi = lo * cl - hi * sl, hi * ch + lo * sh
            if part < NH:
                q_dst = q_buf + layer * R * QW + rows[:, None] * QW + part * D + c[None, :]
                tl.store(q_dst, packed(lo, ep), mask=m)
                tl.store(q_dst + HALF, packed(hi, ep), mask=m)
            else:  # k or v: to the cache for later steps, and (as the cache rounds it) to kv_new for this one
                if part < NH + KV:
                    dst = k_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH) * c_head
                else:
                    dst = v_cache + layer.to(tl.int64) * c_layer + slot * c_slot + (part - NH - KV) * c_head
                dst = dst + (pos + rows[:, None]) * c_pos + c[None, :]
                kv_lo = lo.to(dst.dtype.element_ty)
                kv_hi = hi.to(dst.dtype.element_ty)
                tl.store(dst, kv_lo, mask=m)
                tl.store(dst + HALF, kv_hi, mask=m)
                new_dst = kv_new + ((layer * 2 * KV + part - NH) * NEW_ROWS + rows[:, None]) * D + c[None, :]
                tl.store(new_dst, packed(kv_lo.to(tl.float32), ep), mask=m)
                tl.store(new_dst + HALF, packed(kv_hi.to(tl.float32), ep), mask=m)
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
            if PAIRS:
                hcol = tl.arange(0, HALF)
                store_pairs(attn_buf + layer * R * QW2 + rows[:, None] * QW2 + part * HALF + hcol[None, :], out,
                             rmask[:, None] & (hcol < HALF)[None, :], ep, BR, D)
            else:
                tl.store(attn_buf + layer * R * QW + rows[:, None] * QW + part * D + dcol[None, :], packed(out, ep),
                         mask=m)
        elif op == 2:  # o_proj tile [a, b): h[2l+1] = h[2l] + attn Wo^T
            wl = wo + layer.to(tl.int64) * H * QW
            cols = a + tl.arange(0, BO)
            cm = cols < b
            m = rmask[:, None] & cm[None, :]
            if PAIRS:  # attn as pairs (word j of head h: its columns j and j + HALF); the stream as pairs
                wl1, wl2 = pair_weight_tile(wl, QW, a, b, QW2, BO, QP1, QP2, QPC, HALF, 0)
                wh1, wh2 = pair_weight_tile(wl, QW, a, b, QW2, BO, QP1, QP2, QPC, HALF, 1)
                rc = a // 2 + tl.arange(0, BO // 2)  # the tile's words: BO columns, as the down tile's before it
                rcm = rmask[:, None] & (rc < HS)[None, :]
                src = attn_buf + layer * R * QW2
                if layer == 0:  # the residual is the tokens' embedding rows
                    tok = tl.load(ids + rows, mask=rmask, other=0).to(tl.int64)[:, None] * H
                    res_lo = tl.load(embed + tok + a + tl.arange(0, BO // 2)[None, :], mask=rcm, other=0.0)
                    res_hi = tl.load(embed + tok + a + BO // 2 + tl.arange(0, BO // 2)[None, :], mask=rcm, other=0.0)
                    res_lo, res_hi = res_lo.to(tl.float32), res_hi.to(tl.float32)
                    l1, l2, h1, h2 = awaited_pair_rows(src, rows * QW2, rmask, QW2, QP1, QP2, QPC, ep, NAP)
                else:
                    l1, l2, h1, h2 = awaited_pair_rows(src, rows * QW2, rmask, QW2, QP1, QP2, QPC, ep, NAP)
                    res_lo, res_hi = pair_values(settled_words(h_in + rows[:, None] * HS + rc[None, :], rcm, ep))
                _stamp(trace, it, 1, TRACE)
                y_lo, y_hi = halves(pairs_product(l1, l2, h1, h2, wl1, wl2, wh1, wh2, PREC), BR, BO)
                tl.store(h_in + R * HS + rows[:, None] * HS + rc[None, :], pack_pair(y_lo + res_lo, y_hi + res_hi, ep),
                         mask=rcm)
            else:
                w1, w2 = weight_tile(wl, QW, a, b, QW, BO, Q1, Q2, QC)
                if layer == 0:
                    res = embedding_tile(embed, ids, rows, rmask, cols, m, H)
                    x1, x2 = awaited_rows(attn_buf, rows * QW, rmask, QW, Q1, Q2, QC, ep, NAP)
                else:
                    x1, x2 = awaited_rows(attn_buf + layer * R * QW, rows * QW, rmask, QW, Q1, Q2, QC, ep, NAP)
                    res = settled(h_in + rows[:, None] * H + cols[None, :], m, ep)
                _stamp(trace, it, 1, TRACE)
                y = product(x1, x2, w1, w2, PREC) + res
                tl.store(h_in + R * H + rows[:, None] * H + cols[None, :], packed(y, ep), mask=m)
        elif op == 3:  # gate_up tile [a, b): act = silu(x Wg^T) * (x Wu^T), x = mlp_norm(h[2l+1])
            wl = wgu + layer.to(tl.int64) * 2 * I * H
            if PAIRS:  # the stream as pairs from o_proj tiles of BD columns
                gul1, gul2 = pair_weight_tile_pair(wl, H, a, I + a, b - a, HS, BG, HP1, HP2, HPC, GR, 0)
                guh1, guh2 = pair_weight_tile_pair(wl, H, a, I + a, b - a, HS, BG, HP1, HP2, HPC, GR, 1)
                nl1, nl2, nh1, nh2 = pair_norm_weights(mlp_norm_w + layer * H, HS, HP1, HP2, HPC, GR)
                l1, l2, h1, h2 = awaited_pair_rows(h_in + R * HS, rows * HS, rmask, HS, HP1, HP2, HPC, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                l1, l2, h1, h2 = pair_normed(l1, l2, h1, h2, nl1, nl2, nh1, nh2, eps, H)
                gate, up = halves(pairs_product(l1, l2, h1, h2, gul1, gul2, guh1, guh2, PREC), BR, 2 * BG)
            else:
                gu1, gu2 = weight_tile_pair(wl, H, a, I + a, b - a, H, BG, H1, H2, HC)
                nw1, nw2 = norm_weights(mlp_norm_w + layer * H, H, H1, H2, HC)
                x1, x2 = awaited_rows(h_in + R * H, rows * H, rmask, H, H1, H2, HC, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                x1, x2 = normed(x1, x2, nw1, nw2, eps, H)
                gate, up = halves(product(x1, x2, gu1, gu2, PREC), BR, 2 * BG)
            cols = a + tl.arange(0, BG)
            act = gate / (1.0 + tl.exp(-gate)) * up
            if PAIRS:  # a tile is BG columns (PersistentStep checks): word j holds its columns j and j + BG // 2
                pc = a // 2 + tl.arange(0, BG // 2)
                store_pairs(act_buf + layer * R * AW + rows[:, None] * AW + pc[None, :], act,
                             rmask[:, None] & (pc < b // 2)[None, :], ep, BR, BG)
            else:
                tl.store(act_buf + layer * R * I + rows[:, None] * I + cols[None, :], packed(act, ep),
                         mask=rmask[:, None] & (cols < b)[None, :])
        elif op == 4:  # down tile [a, b): h[2l+2] = h[2l+1] + act Wd^T
            wl = wd + layer.to(tl.int64) * H * I
            cols = a + tl.arange(0, BD)
            m = rmask[:, None] & (cols < b)[None, :]
            taken = tl.load(capture + layer + 1)  # bit j: feature j is the stream entering layer + 1
            if PAIRS:  # act as pairs from gate_up tiles of BG columns; the stream as pairs
                wl1, wl2 = pair_weight_tile(wl, I, a, b, AW, BD, IP1, IP2, IPC, BG // 2, 0)
                wh1, wh2 = pair_weight_tile(wl, I, a, b, AW, BD, IP1, IP2, IPC, BG // 2, 1)
                rc = a // 2 + tl.arange(0, GR)
                rcm = rmask[:, None] & (rc < HS)[None, :]
                l1, l2, h1, h2 = awaited_pair_rows(act_buf + layer * R * AW, rows * AW, rmask, AW, IP1, IP2, IPC, ep,
                                                   NAP)
                res_lo, res_hi = pair_values(settled_words(h_in + R * HS + rows[:, None] * HS + rc[None, :], rcm, ep))
                _stamp(trace, it, 1, TRACE)
                y_lo, y_hi = halves(pairs_product(l1, l2, h1, h2, wl1, wl2, wh1, wh2, PREC), BR, BD)
                y_lo, y_hi = y_lo + res_lo, y_hi + res_hi
                tl.store(h_in + 2 * R * HS + rows[:, None] * HS + rc[None, :], pack_pair(y_lo, y_hi, ep), mask=rcm)
                fc = a + tl.arange(0, GR)[None, :]
                for j in tl.static_range(NCAP):  # the EAGLE-3 features, in the target's dtype
                    if (taken >> j) & 1:
                        f = features + (rows[:, None] * NCAP + j) * H + fc
                        tl.store(f, y_lo.to(features.dtype.element_ty), mask=rcm)
                        tl.store(f + GR, y_hi.to(features.dtype.element_ty), mask=rcm)
            else:
                w1, w2 = weight_tile(wl, I, a, b, I, BD, I1, I2, IC)
                x1, x2 = awaited_rows(act_buf + layer * R * I, rows * I, rmask, I, I1, I2, IC, ep, NAP)
                res = settled(h_in + R * H + rows[:, None] * H + cols[None, :], m, ep)
                _stamp(trace, it, 1, TRACE)
                y = product(x1, x2, w1, w2, PREC) + res
                tl.store(h_in + 2 * R * H + rows[:, None] * H + cols[None, :], packed(y, ep), mask=m)
                for j in tl.static_range(NCAP):  # the EAGLE-3 features, in the target's dtype
                    if (taken >> j) & 1:
                        tl.store(features + (rows[:, None] * NCAP + j) * H + cols[None, :],
                                 y.to(features.dtype.element_ty), mask=m)
        elif op == 5:  # lm_head tile [a, b) of final_norm(h[2L]), and the tile's maximum per row
            if PAIRS:
                nl1, nl2, nh1, nh2 = pair_norm_weights(final_norm_w, HS, HP1, HP2, HPC, GR)
                l1, l2, h1, h2 = awaited_pair_rows(h_buf + 2 * L * R * HS, rows * HS, rmask, HS, HP1, HP2, HPC, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                l1, l2, h1, h2 = pair_normed(l1, l2, h1, h2, nl1, nl2, nh1, nh2, eps, H)
            else:
                nw1, nw2 = norm_weights(final_norm_w, H, H1, H2, HC)
                x1, x2 = awaited_rows(h_buf + 2 * L * R * H, rows * H, rmask, H, H1, H2, HC, ep, NAP)
                _stamp(trace, it, 1, TRACE)
                x1, x2 = normed(x1, x2, nw1, nw2, eps, H)
            best = tl.full((BR,), float("-inf"), tl.float32)
            where = tl.zeros((BR,), tl.int32)
            cn = tl.arange(0, BL)
            for n0 in range(a, b, BL):
                if PAIRS:
                    y = pair_tile_product(l1, l2, h1, h2, lm_head, H, n0, b, HS, BL, HP1, HP2, HPC, GR, PREC)
                else:
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
