"""Rows, weight tiles, norms and products of the persistent step's items (eyas.kernels.persistent_decode).

An item holds the rows it reads and its weight tile as two register blocks each ([chunks, rows, KC columns],
of persistent_decode.split_pow2's widths), multiplies them on the tensor cores one chunk at a time and sums
the chunks. With one value a word a row is read as fp32 words; with pairs (PAIRS: words of two bf16 values,
a row's adjacent columns 2j and 2j + 1) a consumer joins each word's values back into column order right after
its poll, so everything an item does after it is the same code in both formats.
"""

from __future__ import annotations

import triton
import triton.language as tl

from eyas.kernels.persistent_words import (await_both, await_words, pack_pair, packed, pair_values, settled,
                                          settled_words)


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
def awaited_rows(src, rows, rm, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr, ep, NAP: tl.constexpr,
                 PAIRS: tl.constexpr):
    """The step's rows of src, a buffer of K columns a row written this step, awaited, as fp32 blocks
    [K1 // KC, BR, KC], [K2 // KC, BR, KC]; rows outside `rm` are 0. src holds pack's words, or with PAIRS
    pack_pair's (K // 2 words a row), joined back into column order."""
    if PAIRS:
        p1, m1, p2, m2 = _row_blocks(src, rows * (K // 2), rm, K // 2, K1 // 2, K2 // 2, KC // 2)
        w1, w2 = await_words(p1, m1, p2, m2, ep, NAP)
        return joined(w1), joined(w2)
    else:
        p1, m1, p2, m2 = _row_blocks(src, rows * K, rm, K, K1, K2, KC)
        return await_both(p1, m1, p2, m2, ep, NAP)


@triton.jit
def joined(p):
    """pack_pair's words [..., N] as their fp32 values [..., 2 N] in column order: word j holds columns 2j, 2j + 1."""
    lo, hi = pair_values(p)
    both = tl.join(lo, hi)
    return tl.reshape(both, _doubled_last(lo.shape))


@triton.constexpr_function
def _doubled_last(shape):
    return [*shape[:-1], 2 * shape[-1]]


@triton.jit
def settled_tile(src, rows, rm, a, b, K, ep, G: tl.constexpr, PAIRS: tl.constexpr):
    """Columns a..a+G (none from b on) of the step's rows of src, a buffer of K columns a row that an input this
    item polled depends on (settled_words), as fp32 [BR, G]; with PAIRS src holds pack_pair's words (a and b
    even)."""
    if PAIRS:
        wc = a // 2 + tl.arange(0, G // 2)
        words = settled_words(src + rows[:, None] * (K // 2) + wc[None, :], rm[:, None] & (wc < b // 2)[None, :], ep)
        return joined(words)
    else:
        cols = a + tl.arange(0, G)
        return settled(src + rows[:, None] * K + cols[None, :], rm[:, None] & (cols < b)[None, :], ep)


@triton.jit
def store_tile(dst, rows, rm, a, b, K, y, ep, BR: tl.constexpr, G: tl.constexpr, PAIRS: tl.constexpr):
    """y [BR, G] fp32 as columns a..a+G (none from b on) of the step's rows of dst, a buffer of K columns a row:
    pack's words, or with PAIRS pack_pair's, word j holding columns 2j and 2j + 1 (a and b even)."""
    if PAIRS:
        lo, hi = tl.split(tl.reshape(y, (BR, G // 2, 2)))
        wc = a // 2 + tl.arange(0, G // 2)
        tl.store(dst + rows[:, None] * (K // 2) + wc[None, :], pack_pair(lo, hi, ep),
                 mask=rm[:, None] & (wc < b // 2)[None, :])
    else:
        cols = a + tl.arange(0, G)
        tl.store(dst + rows[:, None] * K + cols[None, :], packed(y, ep), mask=rm[:, None] & (cols < b)[None, :])


@triton.jit
def halves(x, BR: tl.constexpr, G: tl.constexpr):
    """x [BR, G] as its first G // 2 columns and its last."""
    return tl.split(tl.permute(tl.reshape(x, (BR, 2, G // 2)), (0, 2, 1)))


@triton.jit
def plain_rows(src, offs, rm, K, K1: tl.constexpr, K2: tl.constexpr, KC: tl.constexpr):
    """Rows src[offs[i] : offs[i] + K], written before the launch (nothing to poll), as awaited_rows' blocks."""
    p1, m1, p2, m2 = _row_blocks(src, offs, rm, K, K1, K2, KC)
    x1 = tl.load(p1, mask=m1, other=0.0)
    x2 = tl.load(p2, mask=m2, other=0.0)
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def token_rows(embed, d2t, ids, rows, rm, H, H1: tl.constexpr, H2: tl.constexpr, HC: tl.constexpr,
               DRAFT: tl.constexpr):
    """The step's tokens' embedding rows, as awaited_rows' blocks. A draft's ids are its own vocabulary's:
    id + d2t[id] is the target's, whose embedding the draft reads."""
    tok = tl.load(ids + rows, mask=rm, other=0).to(tl.int64)
    if DRAFT:
        tok = tok + tl.load(d2t + tok, mask=rm, other=0).to(tl.int64)
    return plain_rows(embed, tok * H, rm, H, H1, H2, HC)


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
def normed_pair(x1, x2, nw1, nw2, g1, g2, mw1, mw2, eps, K):
    """normed(x, nw) and normed(g, mw) over blocks of the same widths (a draft's q/k/v reads two normed inputs),
    their sums of squares reduced together, so the warps' shares are summed once."""
    squares1 = tl.sum(tl.join(x1 * x1, g1 * g1), axis=2)  # [chunks, BR, 2]
    squares2 = tl.sum(tl.join(x2 * x2, g2 * g2), axis=2)
    tx, tg = tl.split(tl.sum(squares1, axis=0) + tl.sum(squares2, axis=0))
    rx = (1.0 / tl.sqrt(tx / K + eps))[None, :, None]
    rg = (1.0 / tl.sqrt(tg / K + eps))[None, :, None]
    return x1 * rx * nw1, x2 * rx * nw2, g1 * rg * mw1, g2 * rg * mw2


@triton.jit
def product(x1, x2, w1, w2, PREC: tl.constexpr):
    """[BR, BN] fp32: rows (awaited_rows' blocks) times a weight tile (weight_tile's blocks) on the tensor cores, one
    product per chunk of columns (so the warps split the sum), then summed over the chunks. The rows are
    rounded to the weights' dtype, as a dense layer's input is; fp32 weights multiply in full fp32 (PREC
    "ieee")."""
    return _block_product(x1, w1, PREC) + _block_product(x2, w2, PREC)


@triton.jit
def product_pair(x1, x2, w1, w2, g1, g2, v1, v2, PREC: tl.constexpr):
    """product(x, w) + product(g, v) over blocks of the same widths (a draft's q/k/v reads two normed inputs):
    the two products' chunks are added before the one sum over them, so the warps' shares are summed once."""
    return (tl.sum(_chunk_products(x1, w1, PREC) + _chunk_products(g1, v1, PREC), axis=0)
            + tl.sum(_chunk_products(x2, w2, PREC) + _chunk_products(g2, v2, PREC), axis=0))


@triton.jit
def _block_product(x, w, PREC: tl.constexpr):
    return tl.sum(_chunk_products(x, w, PREC), axis=0)


@triton.jit
def _chunk_products(x, w, PREC: tl.constexpr):
    """[chunks, BR, BN] fp32: each chunk's product of rows and weight rows, not yet summed."""
    return tl.dot(x.to(w.dtype), tl.permute(w, (0, 2, 1)), out_dtype=tl.float32, input_precision=PREC)


@triton.jit
def stream_rows(h_in, embed, ids, rows, rm, layer, nw1, nw2, eps, H, H1: tl.constexpr, H2: tl.constexpr,
                HC: tl.constexpr, ep, NAP: tl.constexpr, PAIRS: tl.constexpr):
    """The step's rows of the stream entering `layer`, normalized: at layer 0 the tokens' embedding rows."""
    if layer == 0:
        x1, x2 = token_rows(embed, embed, ids, rows, rm, H, H1, H2, HC, False)
    else:
        x1, x2 = awaited_rows(h_in, rows, rm, H, H1, H2, HC, ep, NAP, PAIRS)
    return normed(x1, x2, nw1, nw2, eps, H)
