"""Training-time-test attention, forward and backward, without the [B, H, T, T] score tensors.

At TTT step j the query at index t attends to the step-0 keys of indices 0..t (causal) and, of steps
1..j, only to its own index's key (a diagonal each). The torch path (eyas.train.ttt.ttt_attention_torch) builds
the scores, masks them, concatenates the diagonal columns, takes a softmax and multiplies back, then keeps
the probabilities for the backward: at 32k tokens and 9 heads that is ~0.3 GB per tensor per step, and a
profile of the training step showed the copies, products and misaligned batched matmuls around it as its
largest costs. Here, flash-attention style, each program streams the causal keys of a block of queries
with an online softmax, then folds in the diagonal keys one by one; only the output and the row's
log-sum-exp are written. The backward recomputes the probabilities from them.

Layouts: q [B, T, H, D]; k0, v0 [B, T, G, D] (G kv heads, query head h reads kv head h // (H / G));
kd, vd [J, B, T, G, D], the diagonal keys/values of steps 1..J (J may be 0). Any strides. The softmax runs
in float32 in the base-2 domain (scores scaled by scale * log2 e), and probabilities are rounded to the
value dtype before the p.v product, as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK = 64  # query rows and key columns per tile


@triton.jit
def _tile(T, BLOCK: tl.constexpr):
    """(row block, batch row x head) of this program, the head being a query head (forward) or a kv head
    (backward). One grid axis, row blocks fastest, so the programs of one head run together and share its
    keys in L2: CUDA caps the second and third axes at 65,535 programs, which B x heads passes at large
    batches of short rows."""
    blocks = tl.cdiv(T, BLOCK)
    pid = tl.program_id(0)
    return pid % blocks, pid // blocks


@triton.jit
def _rows(P, rows, st, d, sd, ok):
    """The [rows, D] tile at P (a head's base pointer) + rows * st + d * sd; zeros where not ok."""
    return tl.load(P + rows[:, None] * st + d[None, :] * sd, mask=ok[:, None], other=0.)


@triton.jit
def _lse_delta(LSE, DELTA, base, rows, slt, ok):
    """A head's log-sum-exp and sum(dO * O) at these rows (both [B, H, T], one layout)."""
    return tl.load(LSE + base + rows * slt, mask=ok, other=0.), tl.load(DELTA + base + rows * slt, mask=ok, other=0.)


@triton.jit
def _diagonal_grad(qf, dof, kj, vj, lse, delta, sm2, ok):
    """(p, dS) of each row's own key of one diagonal step, all float32 [rows, D] tiles in."""
    p = tl.where(ok, tl.exp2(tl.sum(qf * kj, 1) * sm2 - lse), 0.)
    return p, p * (tl.sum(dof * vj, 1) - delta)


@triton.jit
def _fwd_kernel(Q, K0, V0, KD, VD, O, LSE, T, J, sm2,
                sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                sdj, sdb, sdt, sdh, sdd, sej, seb, se_t, seh, sed, sob, sot, soh, sod, slb, slh, slt,
                H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, F32: tl.constexpr):
    mblk, bh = _tile(T, BLOCK)
    b = (bh // H).to(tl.int64)
    h = bh % H
    g = h // REP
    rows = mblk * BLOCK + tl.arange(0, BLOCK)
    r_ok = rows < T
    d = tl.arange(0, D)

    q = _rows(Q + b * sqb + h * sqh, rows, sqt, d, sqd, r_ok)
    if F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for n0 in range(0, (mblk + 1) * BLOCK, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        c_ok = cols < T
        kt = tl.load(K0 + b * skb + cols[None, :] * skt + g * skh + d[:, None] * skd, mask=c_ok[None, :], other=0.)
        v = tl.load(V0 + b * svb + cols[:, None] * svt + g * svh + d[None, :] * svd, mask=c_ok[:, None], other=0.)
        if F32:
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee") * sm2
        s = tl.where((cols[None, :] <= rows[:, None]) & c_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    qf = q.to(tl.float32)
    for j in range(J):
        kj = _rows(KD + j * sdj + b * sdb + g * sdh, rows, sdt, d, sdd, r_ok).to(tl.float32)
        vj = _rows(VD + j * sej + b * seb + g * seh, rows, se_t, d, sed, r_ok).to(tl.float32)
        s = tl.sum(qf * kj, 1) * sm2
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vj
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + b * sob + rows[:, None] * sot + h * soh + d[None, :] * sod, o.to(O.dtype.element_ty),
             mask=r_ok[:, None])
    tl.store(LSE + b * slb + h * slh + rows * slt, m_i + tl.log2(l_i), mask=r_ok)


@triton.jit
def _bwd_kv_kernel(Q, K0, V0, DO, LSE, DELTA, DK, DV, T, sm2, scale,
                   sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sob, sot, soh, sod,
                   slb, slh, slt, sgb, sgt, sgh, sgd,
                   H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, F32: tl.constexpr):
    """dk0, dv0 of one block of step-0 keys and one kv head, summed over its query heads and the later rows."""
    nblk, bg = _tile(T, BLOCK)
    G: tl.constexpr = H // REP
    b = (bg // G).to(tl.int64)
    g = bg % G
    cols = nblk * BLOCK + tl.arange(0, BLOCK)
    c_ok = cols < T
    d = tl.arange(0, D)
    k = tl.load(K0 + b * skb + cols[:, None] * skt + g * skh + d[None, :] * skd, mask=c_ok[:, None], other=0.)
    v = tl.load(V0 + b * svb + cols[:, None] * svt + g * svh + d[None, :] * svd, mask=c_ok[:, None], other=0.)
    if F32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK, D], tl.float32)
    dv = tl.zeros([BLOCK, D], tl.float32)
    for r in range(REP):
        h = g * REP + r
        for m0 in range(nblk * BLOCK, T, BLOCK):
            rows = m0 + tl.arange(0, BLOCK)
            r_ok = rows < T
            qt = tl.load(Q + b * sqb + rows[None, :] * sqt + h * sqh + d[:, None] * sqd, mask=r_ok[None, :], other=0.)
            do = _rows(DO + b * sob + h * soh, rows, sot, d, sod, r_ok)
            lse, delta = _lse_delta(LSE, DELTA, b * slb + h * slh, rows, slt, r_ok)
            if F32:
                qt, do = qt.to(tl.float32), do.to(tl.float32)
            st = tl.dot(k, qt, input_precision="ieee") * sm2  # [keys, rows]
            see = (cols[:, None] <= rows[None, :]) & r_ok[None, :] & c_ok[:, None]
            pt = tl.where(see, tl.exp2(st - lse[None, :]), 0.)
            dv += tl.dot(pt.to(do.dtype), do, input_precision="ieee")
            dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision="ieee")
    tl.store(DK + b * sgb + cols[:, None] * sgt + g * sgh + d[None, :] * sgd, (dk * scale).to(DK.dtype.element_ty),
             mask=c_ok[:, None])
    tl.store(DV + b * sgb + cols[:, None] * sgt + g * sgh + d[None, :] * sgd, dv.to(DV.dtype.element_ty),
             mask=c_ok[:, None])


@triton.jit
def _bwd_q_kernel(Q, K0, V0, KD, VD, DO, LSE, DELTA, DQ, DKD, DVD, T, J, sm2, scale,
                  sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                  sdj, sdb, sdt, sdh, sdd, sej, seb, se_t, seh, sed, sob, sot, soh, sod, slb, slh, slt,
                  sxb, sxt, sxh, sxd, syj, syb, syt, syh, syd,
                  H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, F32: tl.constexpr):
    """dq of one block of rows for every query head of one kv head, and the diagonal keys' dk, dv of those
    rows (each summed over the kv head's query heads, so one program owns them)."""
    mblk, bg = _tile(T, BLOCK)
    G: tl.constexpr = H // REP
    b = (bg // G).to(tl.int64)
    g = bg % G
    rows = mblk * BLOCK + tl.arange(0, BLOCK)
    r_ok = rows < T
    d = tl.arange(0, D)
    for r in range(REP):
        h = g * REP + r
        q = _rows(Q + b * sqb + h * sqh, rows, sqt, d, sqd, r_ok)
        do = _rows(DO + b * sob + h * soh, rows, sot, d, sod, r_ok)
        lse, delta = _lse_delta(LSE, DELTA, b * slb + h * slh, rows, slt, r_ok)
        if F32:
            q, do = q.to(tl.float32), do.to(tl.float32)
        dq = tl.zeros([BLOCK, D], tl.float32)
        for n0 in range(0, (mblk + 1) * BLOCK, BLOCK):
            cols = n0 + tl.arange(0, BLOCK)
            c_ok = cols < T
            kt = tl.load(K0 + b * skb + cols[None, :] * skt + g * skh + d[:, None] * skd, mask=c_ok[None, :], other=0.)
            vt = tl.load(V0 + b * svb + cols[None, :] * svt + g * svh + d[:, None] * svd, mask=c_ok[None, :], other=0.)
            if F32:
                kt, vt = kt.to(tl.float32), vt.to(tl.float32)
            s = tl.dot(q, kt, input_precision="ieee") * sm2
            see = (cols[None, :] <= rows[:, None]) & c_ok[None, :] & r_ok[:, None]
            p = tl.where(see, tl.exp2(s - lse[:, None]), 0.)
            dp = tl.dot(do, vt, input_precision="ieee")
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision="ieee")
        qf, dof = q.to(tl.float32), do.to(tl.float32)
        for j in range(J):
            kj = _rows(KD + j * sdj + b * sdb + g * sdh, rows, sdt, d, sdd, r_ok).to(tl.float32)
            vj = _rows(VD + j * sej + b * seb + g * seh, rows, se_t, d, sed, r_ok).to(tl.float32)
            _, ds = _diagonal_grad(qf, dof, kj, vj, lse, delta, sm2, r_ok)
            dq += ds[:, None] * kj
        tl.store(DQ + b * sxb + rows[:, None] * sxt + h * sxh + d[None, :] * sxd, (dq * scale).to(DQ.dtype.element_ty),
                 mask=r_ok[:, None])
    for j in range(J):
        kj = _rows(KD + j * sdj + b * sdb + g * sdh, rows, sdt, d, sdd, r_ok).to(tl.float32)
        vj = _rows(VD + j * sej + b * seb + g * seh, rows, se_t, d, sed, r_ok).to(tl.float32)
        dk = tl.zeros([BLOCK, D], tl.float32)
        dv = tl.zeros([BLOCK, D], tl.float32)
        for r in range(REP):
            h = g * REP + r
            q = _rows(Q + b * sqb + h * sqh, rows, sqt, d, sqd, r_ok).to(tl.float32)
            do = _rows(DO + b * sob + h * soh, rows, sot, d, sod, r_ok).to(tl.float32)
            lse, delta = _lse_delta(LSE, DELTA, b * slb + h * slh, rows, slt, r_ok)
            p, ds = _diagonal_grad(q, do, kj, vj, lse, delta, sm2, r_ok)
            dv += p[:, None] * do
            dk += ds[:, None] * q
        tl.store(DKD + j * syj + b * syb + rows[:, None] * syt + g * syh + d[None, :] * syd,
                 (dk * scale).to(DKD.dtype.element_ty), mask=r_ok[:, None])
        tl.store(DVD + j * syj + b * syb + rows[:, None] * syt + g * syh + d[None, :] * syd,
                 dv.to(DVD.dtype.element_ty), mask=r_ok[:, None])


def check(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor) -> None:
    B, T, H, D = q.shape
    G = k0.shape[2]
    if k0.shape != (B, T, G, D) or v0.shape != k0.shape or kd.shape[1:] != k0.shape or vd.shape != kd.shape:
        raise ValueError(f"q {tuple(q.shape)}, k0 {tuple(k0.shape)}, v0 {tuple(v0.shape)}, kd {tuple(kd.shape)} "
                         f"and vd {tuple(vd.shape)} do not fit [B, T, H, D], [B, T, G, D] and [J, B, T, G, D]")
    if H % G:
        raise ValueError(f"{H} query heads are not a multiple of {G} kv heads")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} is not a power of two >= 16")
    if len({q.dtype, k0.dtype, v0.dtype, kd.dtype, vd.dtype}) != 1:
        raise TypeError("q, k and v must share one dtype")


def _common(q: torch.Tensor, k0: torch.Tensor):
    B, T, H, D = q.shape
    G = k0.shape[2]
    return B, T, H, G, D, dict(H=H, REP=H // G, D=D, BLOCK=BLOCK, F32=not q.is_cuda)


def ttt_attention_forward(q, k0, v0, kd, vd, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, H, D] in q's dtype, lse [B, H, T] float32 in the base-2 domain)."""
    check(q, k0, v0, kd, vd)
    B, T, H, G, D, meta = _common(q, k0)
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    # Triton's interpreter (CPU tensors) multiplies the raw bits of bf16 dot operands: F32 casts them first.
    _fwd_kernel[(triton.cdiv(T, BLOCK) * B * H,)](
        q, k0, v0, kd, vd, out, lse, T, kd.shape[0], scale * LOG2E,
        *q.stride(), *k0.stride(), *v0.stride(), *kd.stride(), *vd.stride(), *out.stride(), *lse.stride(),
        num_warps=4, num_stages=2, **meta)
    return out, lse


def ttt_attention_backward(q, k0, v0, kd, vd, out, lse, grad_out, scale: float):
    """(dq, dk0, dv0, dkd, dvd) for the forward above, each in its input's dtype."""
    B, T, H, G, D, meta = _common(q, k0)
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, T]
    dq = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    dk0 = torch.empty((B, T, G, D), dtype=k0.dtype, device=q.device)
    dv0 = torch.empty_like(dk0)
    dkd = torch.empty(kd.shape, dtype=kd.dtype, device=q.device)
    dvd = torch.empty_like(dkd)
    grid = (triton.cdiv(T, BLOCK) * B * G,)
    _bwd_kv_kernel[grid](
        q, k0, v0, grad_out, lse, delta, dk0, dv0, T, scale * LOG2E, scale,
        *q.stride(), *k0.stride(), *v0.stride(), *grad_out.stride(), *lse.stride(), *dk0.stride(),
        num_warps=4, num_stages=2, **meta)
    _bwd_q_kernel[grid](
        q, k0, v0, kd, vd, grad_out, lse, delta, dq, dkd, dvd, T, kd.shape[0], scale * LOG2E, scale,
        *q.stride(), *k0.stride(), *v0.stride(), *kd.stride(), *vd.stride(), *grad_out.stride(), *lse.stride(),
        *dq.stride(), *dkd.stride(), num_warps=4, num_stages=2, **meta)
    return dq, dk0, dv0, dkd, dvd
