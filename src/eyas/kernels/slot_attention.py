"""Attention straight over the slot KV cache: `store_kv` writes the new keys/values, `slot_attention` reads them.

The torch reference (`attend` in eyas.layers.attention) gathers [B, kv_heads, kv_len, D] copies of the
cache rows and runs SDPA with a dense [B, 1, T, kv_len] boolean mask. These kernels instead read each
sequence's cache row `slots[b]` in place, derive the visibility of every (token, column) pair from
`starts`/`visible`/`new_mask` on the fly, and stop at each row's own column count (starts + T, or
visible + W for trees): short rows in a padded batch cost nothing, and the stale columns past a row's
length are never read. Query heads of one kv head (GQA) share each loaded key/value block.

Softmax is fp32 with online (flash) rescaling. With `splits` > 1 the column range of every row is cut into
that many pieces processed by separate programs (flash-decoding), whose partial (max, sum, acc) are merged
by the last split program of each row block to finish (it learns it is last from a per-block counter,
which it then zeroes): at batch 1 with a few kv heads a single pass would occupy a handful of SMs. With
that in-kernel merge, `splits` is an upper bound: each row takes its own count from its length as the kernel
runs (one pass up to one_pass_columns(), else pieces of SPLIT_COLUMNS or more: attention_splits.py), so one captured graph serves
rows of every length, and programs past a row's count end at once. With the plan's merge_in_kernel=False
(execution_plan) a second small kernel merges instead (one more launch per layer, and a slower step).
With `rotary`, the kernel also does what eyas.kernels.rotary.rotate_and_store does before it, saving that
launch: each program rotates its query rows as it loads them, and rotates and stores the new keys and values
of the columns it will read itself, so no program waits for another (a new column may fall in any split).
What the host decides comes from shapes and the python int `kv_len` (the rest from each row's length, in
the kernel), so no host sync happens and both functions can be captured in a CUDA graph.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from eyas import execution_plan
from eyas.kernels.attention_splits import SPLIT_COLUMNS, attention_block_n, check_columns, choose_splits, \
    merge_unrolled, one_pass_columns
from eyas.kernels.pdl import pdl_args, wait_for_previous
from eyas.kernels.rounding import rounded

LOG2E = 1.4426950408889634
MAX_BLOCK_M = 64  # query rows (token x head of one kv head) per program; more rows take more programs
ROTARY_TENSORS = ("k", "v", "cos", "sin", "positions", "write_pos")  # the kernel's pointer arguments for ROTARY
ROTARY_STRIDES = 13  # k's and v's 4 each, positions' and write_pos' 2 each, the cos/sin tables' row stride


@triton.jit
def _store_kv_kernel(k_cache, v_cache, slots, write_pos, k, v, T, KV_HEADS,
                     s_kcs, s_kch, s_kcc, s_kcd, s_vcs, s_vch, s_vcc, s_vcd,
                     s_wb, s_wt, s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd,
                     D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    bt = tl.program_id(0)
    b = bt // T
    t = bt % T
    slot = tl.load(slots + b).to(tl.int64)
    pos = tl.load(write_pos + b * s_wb + t * s_wt).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < KV_HEADS) & (d < D)
    b64 = b.to(tl.int64)
    t64 = t.to(tl.int64)
    kk = tl.load(k + b64 * s_kb + t64 * s_kt + h * s_kh + d * s_kd, mask=ok)
    tl.store(k_cache + slot * s_kcs + pos * s_kcc + h * s_kch + d * s_kcd, kk, mask=ok)
    vv = tl.load(v + b64 * s_vb + t64 * s_vt + h * s_vh + d * s_vd, mask=ok)
    tl.store(v_cache + slot * s_vcs + pos * s_vcc + h * s_vch + d * s_vcd, vv, mask=ok)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, write_pos: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[slots[b], :, write_pos[b, t]] = k[b, t] (and v), one launch for both.

    Caches [num_slots, kv_heads, max_len, D] (one layer; distinct tensors), slots [B], write_pos [B, T],
    k, v [B, T, kv_heads, D] in the cache dtype, any strides."""
    B, T, kv_heads, D = k.shape
    if B * T == 0:
        return
    pdl = pdl_args(k)
    _store_kv_kernel[(B * T,)](
        k_cache, v_cache, slots, write_pos, k, v, T, kv_heads,
        *k_cache.stride(), *v_cache.stride(), *write_pos.stride(), *k.stride(), *v.stride(),
        D, BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(D), **pdl)


@triton.jit
def _slot_attention_kernel(q, k_cache, v_cache, slots, starts, visible, new_mask, out, part_m, part_l, part_acc,
                           counters, k_new, v_new, cos, sin, pos, wpos,
                           s_qb, s_qt, s_qh, s_qd, s_kcs, s_kch, s_kcc, s_kcd, s_vcs, s_vch, s_vcc, s_vcd,
                           s_mb, s_mt, s_mw, s_nkb, s_nkt, s_nkh, s_nkd, s_nvb, s_nvt, s_nvh, s_nvd,
                           s_pb, s_pt, s_wb, s_wt, s_cos, T, W, cap, qk_scale, M_PAD, SPLITS: tl.constexpr,
                           KV_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, TREE: tl.constexpr, PARTIAL: tl.constexpr,
                           DOT_F32: tl.constexpr, MERGE: tl.constexpr, ROTARY: tl.constexpr,
                           ONE_PASS_COLS: tl.constexpr, SPLIT_COLS: tl.constexpr, UNROLL: tl.constexpr,
                           USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    hk = tl.program_id(1)
    mblk = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T * G
    t = offs_m // G                      # query token of each row
    h = hk * G + offs_m % G              # query head of each row
    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)

    slot = tl.load(slots + b).to(tl.int64)
    start = tl.load(starts + b).to(tl.int32)
    if TREE:
        vis = tl.load(visible + b).to(tl.int32)
        n_cols = vis + W
    else:
        n_cols = start + T
    n_cols = tl.minimum(n_cols, cap)
    splits = SPLITS
    if MERGE:  # this row's own split count: one pass up to ONE_PASS_COLS columns, else SPLIT_COLS per split
        splits = tl.where(n_cols <= ONE_PASS_COLS, 1, tl.minimum(SPLITS, tl.cdiv(n_cols, SPLIT_COLS)))
        if split >= splits:
            return
    # This split's share of the row's columns, in whole blocks; trailing splits of short rows are empty.
    per = ((n_cols + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, n_cols)

    q_ptrs = q + b64 * s_qb + t[:, None].to(tl.int64) * s_qt + h[:, None] * s_qh + offs_d[None, :] * s_qd
    k_row = k_cache + slot * s_kcs + hk * s_kch
    v_row = v_cache + slot * s_vcs + hk * s_vch
    if ROTARY:  # q and the new k arrive unrotated: rotate q's rows here, and store the new k and v first
        dtype: tl.constexpr = k_cache.dtype.element_ty
        partner = (offs_d + D // 2) % D
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        q_pos = tl.load(pos + b64 * s_pb + t.to(tl.int64) * s_pt, mask=m_ok, other=0).to(tl.int64)
        qv = _rotated(q_ptrs, q_ptrs + (partner - offs_d)[None, :] * s_qd, cos + q_pos[:, None] * s_cos,
                      sin + q_pos[:, None] * s_cos, offs_d[None, :], sign[None, :], m_ok[:, None], dtype)
        for tt in range(0, T):  # the new columns this program reads: it writes them itself
            col = tl.load(wpos + b64 * s_wb + tt * s_wt).to(tl.int32)
            if (col >= lo) & (col < hi):
                p = tl.load(pos + b64 * s_pb + tt * s_pt).to(tl.int64)
                k_src = k_new + b64 * s_nkb + tt * s_nkt + hk * s_nkh
                kr = _rotated(k_src + offs_d * s_nkd, k_src + partner * s_nkd, cos + p * s_cos, sin + p * s_cos,
                              offs_d, sign, offs_d < D, dtype)
                tl.store(k_row + col.to(tl.int64) * s_kcc + offs_d * s_kcd, kr)
                vv_new = tl.load(v_new + b64 * s_nvb + tt * s_nvt + hk * s_nvh + offs_d * s_nvd)
                tl.store(v_row + col.to(tl.int64) * s_vcc + offs_d * s_vcd, vv_new)
        tl.debug_barrier()  # the stores, before any thread of the program reads those columns
    else:
        qv = tl.load(q_ptrs, mask=m_ok[:, None], other=0.).to(k_cache.dtype.element_ty)
    if DOT_F32:
        qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        kt = tl.load(k_row + cols[None, :].to(tl.int64) * s_kcc + offs_d[:, None] * s_kcd, mask=c_ok[None, :],
                     other=0.)
        # The block's values are loaded beside its keys, so both reads are in flight at once: a short split
        # runs one or two blocks, each otherwise two memory round trips one after the other.
        vv = tl.load(v_row + cols[:, None].to(tl.int64) * s_vcc + offs_d[None, :] * s_vcd, mask=c_ok[:, None],
                     other=0.)
        if DOT_F32:
            kt = kt.to(tl.float32)
            vv = vv.to(tl.float32)
        s = tl.dot(qv, kt, input_precision="ieee") * qk_scale
        if TREE:
            rel = cols[None, :] - vis
            inside = (rel >= 0) & (rel < W) & m_ok[:, None] & c_ok[None, :]
            nm = tl.load(new_mask + b64 * s_mb + t[:, None] * s_mt + rel * s_mw, mask=inside, other=0)
            see = (cols[None, :] < vis) | (nm != 0)
        else:
            see = cols[None, :] <= start + t[:, None]
        see = see & c_ok[None, :]
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0., m_new)   # rows that have seen nothing yet stay at zero
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
        m_i = m_new

    if PARTIAL:
        if splits > 1:
            row = ((b64 * KV_HEADS + hk) * SPLITS + split) * M_PAD + offs_m
            tl.store(part_m + row, m_i)
            tl.store(part_l + row, l_i)
            tl.store(part_acc + row[:, None] * D + offs_d[None, :], acc)
            if MERGE:  # the row block's last split program to finish merges, instead of a second kernel
                tl.debug_barrier()  # every thread's partial stores, before the counter is released
                m_blocks = tl.num_programs(2) // SPLITS
                counter = counters + (b * KV_HEADS + hk) * m_blocks + mblk
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1:
                    _merge_splits(out, part_m, part_l, part_acc, b, hk, mblk, T, splits, M_PAD, SPLITS, KV_HEADS,
                                  G, D, BLOCK_M, ".cg", UNROLL)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
        else:  # a row short enough for one pass, in a split launch
            _store_rows(out, acc, l_i, b64, T, t, h, offs_d, m_ok, KV_HEADS, G, D)
    else:
        _store_rows(out, acc, l_i, b64, T, t, h, offs_d, m_ok, KV_HEADS, G, D)


@triton.jit
def _store_rows(out, acc, l_i, b64, T, t, h, offs_d, m_ok, KV_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """The finished rows of one pass over every column: acc / l into out [B, T, H * D]."""
    o = acc / tl.where(l_i > 0, l_i, 1.)[:, None]
    o_ptrs = out + (b64 * T + t[:, None]) * (KV_HEADS * G * D) + h[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _rotated(x_ptrs, partner_ptrs, cos_row, sin_row, offs, sign, mask, dtype: tl.constexpr):
    """The rotary embedding of one or more heads, as eyas.kernels.rotary rounds it: out[d] =
    x[d] * cos[d] -/+ x[d -/+ D/2] * sin[d], each product and the sum rounded to `dtype`."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    c = rounded(tl.load(cos_row + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    s = rounded(tl.load(sin_row + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    return rounded(rounded(x * c, dtype) + rounded(sign * xp * s, dtype), dtype).to(dtype)


@triton.jit
def _merge_splits(out, part_m, part_l, part_acc, b, hk, mblk, T, used, M_PAD, SPLITS: tl.constexpr,
                  KV_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, CACHE: tl.constexpr,
                  UNROLL: tl.constexpr):
    """Row block mblk of (b, hk): the partial (max, sum, acc) of its first `used` of SPLITS splits merged
    into the output rows. CACHE is the partials' load modifier: ".cg" (from L2, where other programs'
    stores are) inside the attention kernel, "" in the merge kernel.

    With UNROLL the loops over splits are unrolled (SPLITS is a constant; splits past `used` are masked off),
    so the loads of every split's partials are in flight together instead of one round trip per split in
    turn; without it (merge_unrolled: partials too many for registers) they are read one split after the
    other. The same sums in the same order either way."""
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T * G
    t = offs_m // G
    h = hk * G + offs_m % G
    offs_d = tl.arange(0, D)
    base = (b.to(tl.int64) * KV_HEADS + hk) * SPLITS * M_PAD + offs_m

    m_g = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if UNROLL:
        for s in tl.static_range(SPLITS):
            ok = m_ok & (tl.full([BLOCK_M], s, tl.int32) < used)
            m_g = tl.maximum(m_g, tl.load(part_m + base + s * M_PAD, mask=ok, other=float("-inf"),
                                          cache_modifier=CACHE))
    else:
        for s in range(used):
            m_g = tl.maximum(m_g, tl.load(part_m + base + s * M_PAD, mask=m_ok, other=float("-inf"),
                                          cache_modifier=CACHE))
    m_use = tl.where(m_g == float("-inf"), 0., m_g)
    l_g = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if UNROLL:
        for s in tl.static_range(SPLITS):
            ok = m_ok & (tl.full([BLOCK_M], s, tl.int32) < used)
            l_g, acc = _merge_one(part_m, part_l, part_acc, base + s * M_PAD, ok, m_use, l_g, acc, offs_d, D, CACHE)
    else:
        for s in range(used):
            l_g, acc = _merge_one(part_m, part_l, part_acc, base + s * M_PAD, m_ok, m_use, l_g, acc, offs_d, D, CACHE)
    o = acc / tl.where(l_g > 0, l_g, 1.)[:, None]
    o_ptrs = out + (b.to(tl.int64) * T + t[:, None]) * (KV_HEADS * G * D) + h[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _merge_one(part_m, part_l, part_acc, row, ok, m_use, l_g, acc, offs_d, D: tl.constexpr, CACHE: tl.constexpr):
    """One split's partial rows added into the running (l, acc), weighed by exp2(its max - m_use)."""
    # empty and unused splits (max -inf) weigh nothing
    w = tl.exp2(tl.load(part_m + row, mask=ok, other=float("-inf"), cache_modifier=CACHE) - m_use)
    l_g += w * tl.load(part_l + row, mask=ok, other=0., cache_modifier=CACHE)
    acc += w[:, None] * tl.load(part_acc + row[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.,
                                cache_modifier=CACHE)
    return l_g, acc


@triton.jit
def _combine_splits_kernel(out, part_m, part_l, part_acc, T, M_PAD, SPLITS: tl.constexpr,
                           KV_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                           UNROLL: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    _merge_splits(out, part_m, part_l, part_acc, tl.program_id(0), tl.program_id(1), tl.program_id(2), T, SPLITS,
                  M_PAD, SPLITS, KV_HEADS, G, D, BLOCK_M, "", UNROLL)


_counters: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # counters replaced by larger ones, kept alive for the graphs using them


def merge_in_kernel(q: torch.Tensor, blocks: int) -> torch.Tensor | None:
    """The zeroed per-row-block counters with which the attention kernel merges its splits itself, or None
    to launch the merge kernel (the plan's merge_in_kernel=False, or during a graph capture before any eager
    run). The counters live per device and are zero between launches (the merging program resets its own); they are
    only allocated outside CUDA-graph capture, whose first, eager warm-up run allocates them. Kernels on one
    device share them, which is safe for launches in one stream."""
    if not execution_plan.current().merge_in_kernel:
        return None
    have = _counters.get(q.device)
    if have is None or have.numel() < blocks:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:  # a captured graph may hold it: it must never be freed and handed out again
            _outgrown.append(have)
        _counters[q.device] = have = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=q.device)
    return have


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   starts: torch.Tensor, scale: float, new_mask: torch.Tensor | None = None,
                   visible: torch.Tensor | None = None, kv_len: int | None = None,
                   splits: int | None = None, rotary: tuple | None = None, block_n: int | None = None,
                   split_cols: int = SPLIT_COLUMNS, one_pass_cols: int | None = None) -> torch.Tensor:
    """`attend()` after the new keys/values are in the cache: q [B, T, H, D] -> [B, T, H*D] in q.dtype.

    Caches [num_slots, kv_heads, max_len, D] (one layer), H = kv_heads * G; slots, starts, visible [B] integer;
    new_mask [B, T, W] bool for trees (None: causal). Row b attends to columns < starts[b] + T (causal) or
    < visible[b] + W (tree), never beyond kv_len. `splits` overrides the split-K heuristic; the tile keywords
    block_n (cache columns per loop step), split_cols (least columns per split) and one_pass_cols (columns up
    to which a row runs in one pass) override attention_splits' defaults, for timing.

    rotary = (k, v, cos, sin, positions, write_pos): q and the new k are not yet rotated, nor k and v stored.
    The kernel then does what eyas.kernels.rotary.rotate_and_store would have done before it, for the same
    bits: k [B, T, kv_heads, D] and v, cos/sin tables [max_positions, D], positions and write_pos [B, T]."""
    B, T, H, D = q.shape
    _, kv_heads, max_len, Dk = k_cache.shape
    if D != Dk or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"query head dim {D} does not match the caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} is not a power of two >= 16")
    if H % kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {kv_heads} kv heads")
    G = H // kv_heads
    out = torch.empty((B, T, H * D), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    cap = max_len if kv_len is None else min(kv_len, max_len)
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(T * G)))
    m_blocks = triton.cdiv(T * G, block_m)
    block_n = attention_block_n(D) if block_n is None else check_columns("block_n", block_n)
    split_cols = check_columns("split_cols", split_cols)
    if one_pass_cols is None:
        one_pass_cols = one_pass_columns(D)
    elif not isinstance(one_pass_cols, int) or one_pass_cols < 0:
        raise ValueError(f"one_pass_cols={one_pass_cols!r} is not a number of columns")
    if splits is None:
        splits = choose_splits(B * kv_heads * m_blocks, cap, split_cols)
    tree = new_mask is not None
    if tree:
        mask = new_mask.view(torch.uint8) if new_mask.dtype == torch.bool else new_mask
        vis = starts if visible is None else visible
        mask_strides, W = mask.stride(), mask.shape[-1]
    else:
        mask, vis, mask_strides, W = starts, starts, (0, 0, 0), 0
    m_pad = m_blocks * block_m
    if splits > 1:
        part_ml = torch.empty((2, B, kv_heads, splits, m_pad), dtype=torch.float32, device=q.device)
        part_m, part_l = part_ml[0], part_ml[1]
        part_acc = torch.empty((B, kv_heads, splits, m_pad, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out
    num_warps = 8 if D >= 256 else 4
    unroll = merge_unrolled(splits, block_m, D)
    pdl = pdl_args(q)
    if rotary is not None:
        k_new, v_new, cos, sin, positions, write_pos = rotary
        if k_new.shape != (B, T, kv_heads, D) or v_new.shape != k_new.shape or positions.shape != (B, T) \
                or write_pos.shape != (B, T) or cos.shape != sin.shape or cos.shape[1] != D:
            raise ValueError(f"rotary: k {tuple(k_new.shape)}, v {tuple(v_new.shape)}, positions "
                             f"{tuple(positions.shape)}, write_pos {tuple(write_pos.shape)}, cos/sin "
                             f"{tuple(cos.shape)} do not fit q {tuple(q.shape)} and the caches")
        if len({q.dtype, k_new.dtype, v_new.dtype, k_cache.dtype}) != 1:
            raise TypeError("rotary: q, k, v and the caches must share one dtype")
        cos, sin = cos.contiguous(), sin.contiguous()
        rot_args = (k_new, v_new, cos, sin, positions, write_pos)  # in ROTARY_TENSORS' order
        rot_strides = (*k_new.stride(), *v_new.stride(), *positions.stride(), *write_pos.stride(), cos.stride(0))
        # The rotation must round as the rotary kernel does. In bf16/fp16 its explicit rounding steps already
        # keep products from contracting into FMAs; fp32 has none, so there contraction is turned off, for
        # the whole kernel (its attention arithmetic too).
        options = {**pdl, "enable_fp_fusion": False} if q.dtype == torch.float32 else pdl
    else:
        # ROTARY off: its pointer arguments are never read (any tensor will do), its strides are zeros.
        rot_args, rot_strides, options = (slots,) * len(ROTARY_TENSORS), (0,) * ROTARY_STRIDES, pdl
    counters = merge_in_kernel(q, B * kv_heads * m_blocks) if splits > 1 else None
    _slot_attention_kernel[(B, kv_heads, m_blocks * splits)](
        q, k_cache, v_cache, slots, starts, vis, mask, out, part_m, part_l, part_acc,
        counters if counters is not None else slots, *rot_args,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_strides, *rot_strides,
        T, W, cap, scale * LOG2E, m_pad, SPLITS=splits,
        KV_HEADS=kv_heads, G=G, D=D, BLOCK_M=block_m, BLOCK_N=block_n, TREE=tree, PARTIAL=splits > 1,
        MERGE=counters is not None, ROTARY=rotary is not None, ONE_PASS_COLS=one_pass_cols,
        SPLIT_COLS=split_cols, UNROLL=unroll,
        DOT_F32=not q.is_cuda,  # Triton's interpreter (CPU tensors) multiplies the raw bits of bf16 dot operands
        num_warps=num_warps, num_stages=2, **options)
    if splits > 1 and counters is None:
        _combine_splits_kernel[(B, kv_heads, m_blocks)](
            out, part_m, part_l, part_acc, T, m_pad, SPLITS=splits,
            KV_HEADS=kv_heads, G=G, D=D, BLOCK_M=block_m, UNROLL=unroll, num_warps=num_warps, **pdl)
    return out
