"""Rows, weight tiles, norms and products of the persistent step's items (eyas.kernels.persistent_decode).

An item holds the rows it reads and its weight tile as two register blocks each ([chunks, rows, KC columns],
of persistent_decode.split_pow2's widths), multiplies them on the tensor cores one chunk at a time and sums
the chunks. With one value a word a row is read as fp32 words; with pairs (a bf16 target's passes of four
rows or more) as words of two bf16 values, a producer of G columns pairing its column j with j + G / 2, so a
consumer holds each block's low and high halves and loads its weight columns in that order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from eyas.kernels.persistent_words import await_both, await_words, pack_pair, pair_values


@triton.jit
def _chunks(K1: tl.constexpr, KC: tl.constexpr, first):
    """Column offsets [K1 // KC, 1, KC] of a block of K1 columns starting at `first`, cut into chunks of KC."""
    return first + tl.arange(0, K1 // KC)[:, None, None] * KC + tl.arange(0, KC)[None, None, :]


@triton.jit
def _weight_rows(w, stride, r, ok, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Weight rows r [1, N, 1] of W [*, K] (rows where not ok are 0) as two register blocks [K1 // KC, N, KC],
    [K2 // KC, N, KC]: columns cut into chunks of KC, so that a product splits its sum over the chunks."""
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    w1 = tl.load(w + r * stride + c1, mask=ok, other=0.0)
    w2 = tl.load(w + r * stride + c2, mask=ok & (c2 < K), other=0.0)
    return w1, w2


@triton.jit
def weight_tile(w, stride, n0, n_end, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Weight rows n0..n_end of W [*, K] (rows past n_end are 0) as _weight_rows' blocks of BN rows."""
    n = (n0 + tl.arange(0, BN))[None, :, None]
    return _weight_rows(w, stride, n, n < n_end, K, K1, K2, KC)


@triton.jit
def _two_runs(n0, m0, n, BN: tl.constexpr):
    """Rows n0..n0+n then m0..m0+n as 2 BN rows [1, 2 BN, 1], and which of them are real (not past n)."""
    j = tl.arange(0, 2 * BN)
    r = tl.where(j < BN, n0 + j, m0 + j - BN)
    return r[None, :, None], (j % BN < n)[None, :, None]


@triton.jit
def weight_tile_pair(w, stride, n0, m0, n, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Weight rows n0..n0+n then m0..m0+n of W [*, K] as one tile of 2 BN rows (rows past n in each half are 0):
    one product serves both, so its chunks are summed once."""
    r, ok = _two_runs(n0, m0, n, BN)
    return _weight_rows(w, stride, r, ok, K, K1, K2, KC)


@triton.jit
def _row_blocks(src, offs, rm, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Pointers and masks of rows src[offs[i] : offs[i] + K] as two blocks [K1 // KC, BR, KC],
    [K2 // KC, BR, KC] (_chunks' columns); rows outside `rm` are masked."""
    at = offs[None, :, None]
    m = rm[None, :, None]
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    return src + at + c1, m & (c1 < K), src + at + c2, m & (c2 < K)


@triton.jit
def awaited_rows(src, offs, rm, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr, ep, NAP: tl.constexpr):
    """Rows src[offs[i] : offs[i] + K] of packed words written this step, awaited, as fp32 blocks
    [K1 // KC, BR, KC], [K2 // KC, BR, KC]; rows outside `rm` are 0."""
    p1, m1, p2, m2 = _row_blocks(src, offs, rm, K, K1, K2, KC)
    return await_both(p1, m1, p2, m2, ep, NAP)


@triton.jit
def awaited_pair_rows(src, offs, rm, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr, ep, NAP: tl.constexpr):
    """Rows of pack_pair's words src[offs[i] : offs[i] + K], awaited: the low halves' values as awaited_rows' blocks,
    then the high halves'."""
    p1, m1, p2, m2 = _row_blocks(src, offs, rm, K, K1, K2, KC)
    w1, w2 = await_words(p1, m1, p2, m2, ep, NAP)
    l1, h1 = pair_values(w1)
    l2, h2 = pair_values(w2)
    return l1, l2, h1, h2


@triton.jit
def halves(x, BR: tl.constexpr, G: tl.constexpr):
    """x [BR, G] as its first G // 2 columns and its last."""
    return tl.split(tl.permute(tl.reshape(x, (BR, 2, G // 2)), (0, 2, 1)))


@triton.jit
def store_pairs(dst, x, mask, ep, BR: tl.constexpr, G: tl.constexpr):
    """x [BR, G] fp32 (a producer's G columns) as G // 2 pack_pair words a row at dst [BR, G // 2]: word j
    holds columns j and j + G // 2."""
    lo, hi = halves(x, BR, G)
    tl.store(dst, pack_pair(lo, hi, ep), mask=mask)


@triton.jit
def _pair_cols(c, GH: tl.constexpr, HI: tl.constexpr):
    """The column in word c's low (HI 0) or high (HI 1) half, in a row of pairs from producers of 2 GH columns
    each (store_pairs): stretches of GH columns, so loads by these columns stay vectorized."""
    return (c // GH) * (2 * GH) + c % GH + HI * GH


@triton.jit
def _pair_weight_rows(w, stride, r, ok, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr, GH: tl.constexpr,
                      HI: tl.constexpr):
    """_weight_rows' blocks for a row of K pair words: the weight columns of their low (HI 0) or high halves."""
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    w1 = tl.load(w + r * stride + _pair_cols(c1, GH, HI), mask=ok, other=0.0)
    w2 = tl.load(w + r * stride + _pair_cols(c2, GH, HI), mask=ok & (c2 < K), other=0.0)
    return w1, w2


@triton.jit
def pair_weight_tile(w, stride, n0, n_end, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr,
               GH: tl.constexpr, HI: tl.constexpr):
    """weight_tile's blocks for a row of K pair words (_pair_weight_rows)."""
    n = (n0 + tl.arange(0, BN))[None, :, None]
    return _pair_weight_rows(w, stride, n, n < n_end, K, K1, K2, KC, GH, HI)


@triton.jit
def pair_weight_tile_pair(w, stride, n0, m0, n, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                    KC: tl.constexpr, GH: tl.constexpr, HI: tl.constexpr):
    """weight_tile_pair's blocks for a row of K pair words (_pair_weight_rows)."""
    r, ok = _two_runs(n0, m0, n, BN)
    return _pair_weight_rows(w, stride, r, ok, K, K1, K2, KC, GH, HI)


@triton.jit
def pair_norm_weights(norm_w, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr, GH: tl.constexpr):
    """An rmsnorm's weights as fp32 blocks shaped like awaited_pair_rows' (one row): low halves', then high halves'."""
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    l1 = tl.load(norm_w + _pair_cols(c1, GH, 0)).to(tl.float32)
    l2 = tl.load(norm_w + _pair_cols(c2, GH, 0), mask=c2 < K, other=0.0).to(tl.float32)
    h1 = tl.load(norm_w + _pair_cols(c1, GH, 1)).to(tl.float32)
    h2 = tl.load(norm_w + _pair_cols(c2, GH, 1), mask=c2 < K, other=0.0).to(tl.float32)
    return l1, l2, h1, h2


@triton.jit
def pair_stream_rows(h_in, embed, ids, rows, rm, layer, nl1, nl2, nh1, nh2, eps, H, K, K1: tl.constexpr,
                      K2: tl.constexpr, KC: tl.constexpr, GH: tl.constexpr, ep, NAP: tl.constexpr):
    """stream_rows of a stream of pairs (K words a row), as awaited_pair_rows' blocks, normalized."""
    if layer == 0:  # the embedding rows, loaded in the pairs' column order
        tok = tl.load(ids + rows, mask=rm, other=0).to(tl.int64)[None, :, None]
        l1, l2 = _pair_weight_rows(embed, H, tok, rm[None, :, None], K, K1, K2, KC, GH, 0)
        h1, h2 = _pair_weight_rows(embed, H, tok, rm[None, :, None], K, K1, K2, KC, GH, 1)
        l1, l2, h1, h2 = l1.to(tl.float32), l2.to(tl.float32), h1.to(tl.float32), h2.to(tl.float32)
    else:
        l1, l2, h1, h2 = awaited_pair_rows(h_in, rows * K, rm, K, K1, K2, KC, ep, NAP)
    return pair_normed(l1, l2, h1, h2, nl1, nl2, nh1, nh2, eps, H)


@triton.jit
def pair_normed(l1, l2, h1, h2, nl1, nl2, nh1, nh2, eps, H):
    """normed of awaited_pair_rows' blocks (H columns in all)."""
    # each block's low and high squares added before its reductions: two cross-warp reductions, not four
    total = tl.sum(tl.sum(l1 * l1 + h1 * h1, axis=2), axis=0) + tl.sum(tl.sum(l2 * l2 + h2 * h2, axis=2), axis=0)
    rstd = (1.0 / tl.sqrt(total / H + eps))[None, :, None]
    return l1 * rstd * nl1, l2 * rstd * nl2, h1 * rstd * nh1, h2 * rstd * nh2


@triton.jit
def pair_tile_product(l1, l2, h1, h2, w, stride, n0, n_end, K, BN: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                  KC: tl.constexpr, GH: tl.constexpr, PREC: tl.constexpr):
    """product of awaited_pair_rows' blocks and weight rows n0..n_end, their tile loaded here (the LM head's loop)."""
    wl1, wl2 = pair_weight_tile(w, stride, n0, n_end, K, BN, K1, K2, KC, GH, 0)
    wh1, wh2 = pair_weight_tile(w, stride, n0, n_end, K, BN, K1, K2, KC, GH, 1)
    return pairs_product(l1, l2, h1, h2, wl1, wl2, wh1, wh2, PREC)


@triton.jit
def pairs_product(l1, l2, h1, h2, wl1, wl2, wh1, wh2, PREC: tl.constexpr):
    """product of pair rows (awaited_pair_rows' low and high blocks) and their weight blocks (pair_weight_tile's): each
    chunk's low and high products are added before the chunks are summed, so a block costs one cross-warp
    reduction, not two."""
    return (tl.sum(_chunk_products(l1, wl1, PREC) + _chunk_products(h1, wh1, PREC), axis=0)
            + tl.sum(_chunk_products(l2, wl2, PREC) + _chunk_products(h2, wh2, PREC), axis=0))


@triton.jit
def _embedding_rows(embed, ids, rows, rm, H, H1: tl.constexpr, H2: tl.constexpr, HC: tl.constexpr):
    """The step's tokens' embedding rows, as awaited_rows' blocks."""
    offs = tl.load(ids + rows, mask=rm, other=0).to(tl.int64) * H
    p1, m1, p2, m2 = _row_blocks(embed, offs, rm, H, H1, H2, HC)
    x1 = tl.load(p1, mask=m1, other=0.0)
    x2 = tl.load(p2, mask=m2, other=0.0)
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def embedding_tile(embed, ids, rows, rm, cols, m, H):
    """Columns `cols` of the step's tokens' embedding rows (rows outside `rm` masked), fp32 [BR, BN]: layer 0's
    residual."""
    tok = tl.load(ids + rows, mask=rm, other=0).to(tl.int64)
    return tl.load(embed + tok[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def norm_weights(norm_w, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """An rmsnorm's weights as fp32 blocks shaped like awaited_rows' (one row). Items load them before they poll
    their inputs, so the load's round trip overlaps the wait instead of following it."""
    c1 = _chunks(K1, KC, 0)
    c2 = _chunks(K2, KC, K1)
    w1 = tl.load(norm_w + c1).to(tl.float32)
    w2 = tl.load(norm_w + c2, mask=c2 < K, other=0.0).to(tl.float32)
    return w1, w2


@triton.jit
def normed(x1, x2, nw1, nw2, eps, K):
    """rmsnorm of each row of awaited_rows' blocks, times the norm's weights (norm_weights' blocks)."""
    total = tl.sum(tl.sum(x1 * x1, axis=2), axis=0) + tl.sum(tl.sum(x2 * x2, axis=2), axis=0)
    rstd = (1.0 / tl.sqrt(total / K + eps))[None, :, None]
    return x1 * rstd * nw1, x2 * rstd * nw2


@triton.jit
def product(x1, x2, w1, w2, PREC: tl.constexpr):
    """[BR, BN] fp32: rows (awaited_rows' blocks) times a weight tile (weight_tile's blocks) on the tensor cores, one
    product per chunk of columns (so the warps split the sum), then summed over the chunks. The rows are
    rounded to the weights' dtype, as a dense layer's input is; fp32 weights multiply in full fp32 (PREC
    "ieee")."""
    return _block_product(x1, w1, PREC) + _block_product(x2, w2, PREC)


@triton.jit
def _block_product(x, w, PREC: tl.constexpr):
    return tl.sum(_chunk_products(x, w, PREC), axis=0)


@triton.jit
def _chunk_products(x, w, PREC: tl.constexpr):
    """[chunks, BR, BN] fp32: each chunk's product of rows and weight rows, not yet summed."""
    return tl.dot(x.to(w.dtype), tl.permute(w, (0, 2, 1)), out_dtype=tl.float32, input_precision=PREC)


@triton.jit
def stream_rows(h_in, embed, ids, rows, rm, layer, nw1, nw2, eps, H, H1: tl.constexpr, H2: tl.constexpr,
                 HC: tl.constexpr, ep, NAP: tl.constexpr):
    """The step's rows of the stream entering `layer`, normalized: at layer 0 the tokens' embedding rows."""
    if layer == 0:
        x1, x2 = _embedding_rows(embed, ids, rows, rm, H, H1, H2, HC)
    else:
        x1, x2 = awaited_rows(h_in, rows * H, rm, H, H1, H2, HC, ep, NAP)
    return normed(x1, x2, nw1, nw2, eps, H)
