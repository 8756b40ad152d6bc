"""Epoch-tagged words: how the persistent step's items pass values to each other without counters.

A word is an int64: a 32-bit payload (an int32, or an fp32 value's bits) in the low half and the step's
epoch in the high half. An 8-byte store is seen whole, so a reader that sees this step's epoch in a word
sees this step's value in it: a consumer polls the data itself until every word it needs carries the
epoch, with no counter, release fence or second load between a producer's store and its use, and no
buffer needs clearing between steps (the next step's epoch is new). A bf16 target's values may travel two
bf16 to a word (pack_pair), halving what a boundary stores and polls.

A poll's loop ends on a reduction of what the program loaded, but where a tensor is smaller than the
program's threads, several threads hold copies of one word, and the reduction sees one copy: another thread
may leave the loop holding a stale copy (a 1-row step read stale words this way on an H100). So on a GPU
each thread then checks its own copies and reloads any stale one until it carries the epoch (_fresh).

Nor need the warps agree on the loop's exit. Triton reduces at most a warp's 32 values within each warp, with
no shared-memory stage, and where the tensor's copies span the warps, each warp reduces copies it loaded itself,
at its own time: one warp may see a word fresh that another saw stale, and leave the loop a round earlier. From
there on their barriers pair up wrongly (a warp's next reduction meets another's poll round) and the program
computes on garbage or never finishes (the likely cause of 1-row steps that hung on an H100 polling a 32-word
block). A poll with such a tensor therefore decides each round by a vote of all the program's threads (_agreed).
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)  # as triton.jit decides: one thread per program

# $0 = $1 unless the mask ($3, a predicate) is set and $1's high half is not the epoch ($4, one register for
# all words): then reloaded from the word's address ($2), bypassing L1, until it is. PTX labels are local to
# the braces. The mask as a predicate, not an int32 per word, keeps the 4-row step's spills down.
_RELOAD_STALE = tl.constexpr("""{
.reg .pred stale;
.reg .b32 wlo, whi;
mov.b64 $0, $1;
mov.b64 {wlo, whi}, $0;
setp.ne.s32 stale, whi, $4;
and.pred stale, stale, $3;
@!stale bra FRESH;
RELOAD:
ld.volatile.global.b64 $0, [$2];
mov.b64 {wlo, whi}, $0;
setp.ne.s32 stale, whi, $4;
@stale bra RELOAD;
FRESH:
}""")


# 100 ns of PTX nanosleep between a poll's rounds, then $0 = $1 (a result keeps the sleep in place).
_NAP = tl.constexpr("nanosleep.u32 100;\nmov.b32 $0, $1;")

# $0 = 1 if $1 is nonzero in any of the program's threads, else 0, in every thread: a barrier reduction (PTX
# bar.red.or on barrier 0, as CUDA's __syncthreads_or), which every thread of the program must reach.
_ANY_THREAD = tl.constexpr("""{
.reg .pred mine, any;
setp.ne.s32 mine, $1, 0;
bar.red.or.pred any, 0, mine;
selp.s32 $0, 1, 0, any;
}""")

# Triton reduces a tensor of at most this many values within each warp (no shared-memory stage).
WARP_REDUCED = tl.constexpr(32)


@triton.jit
def _nap(ep):
    """ep, after 100 ns of sleep on a GPU: a poll that naps between rounds loads L2 less while it waits."""
    if INTERPRETED:
        return ep
    else:
        return tl.inline_asm_elementwise(_NAP, "=r,r", [ep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pack(bits, ep):
    """int64 words of a 32-bit payload (int32; an fp32 value bitcast) and the step's epoch in the high half: an
    8-byte store is seen whole, so a reader that sees this step's epoch sees this step's value."""
    return (ep.to(tl.int64) << 32) | (bits.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def packed(x, ep):
    return pack(x.to(tl.int32, bitcast=True), ep)


@triton.jit
def payload(p):
    """The int32 payload of pack's words."""
    return (p & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _stale(p, mask, ep):
    """1 while any masked word of p lacks epoch ep, else 0."""
    return tl.max(tl.where(mask, (p >> 32) != ep, False).to(tl.int32))


@triton.jit
def _fresh(p, ptrs, mask, ep):
    """p with every masked word this thread holds carrying epoch ep: a stale copy is reloaded until it does."""
    if INTERPRETED:
        return p
    else:
        return tl.inline_asm_elementwise(_RELOAD_STALE, "=l,l,l,b,r",
                                         [p, ptrs.to(tl.int64), mask, ep],
                                         dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def pack_pair(lo, hi, ep):
    """Words of two fp32 values rounded to bf16 (to nearest, ties to even, as .to(bf16) rounds finite values;
    done on the bits, so the interpreter runs it too): lo in the payload's low 16 bits, hi in its high 16."""
    return pack(_bf16_bits(lo) | (_bf16_bits(hi) << 16), ep)


@triton.jit
def _bf16_bits(x):
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def pair_values(p):
    """The two fp32 values (lo, hi) of pack_pair's words."""
    bits = payload(p)
    return (bits << 16).to(tl.float32, bitcast=True), (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _value(p):
    """The fp32 value of pack's words."""
    return payload(p).to(tl.float32, bitcast=True)


@triton.jit
def _agreed(stale):
    """1 if `stale` (a thread's count of stale words, as its warp reduced them) is nonzero in any of the
    program's threads, else 0, the same in every warp: a poll loop's exit that all warps take in the same
    round. The interpreter runs a program as one thread."""
    if INTERPRETED:
        return stale
    else:
        mine = tl.full([1], 0, tl.int32) + stale  # a tensor, so that each thread votes once with its own value
        return tl.max(tl.inline_asm_elementwise(_ANY_THREAD, "=r,r", [mine], dtype=tl.int32, is_pure=False,
                                                pack=1))


@triton.jit
def _reload(ptrs1, mask1, ptrs2, mask2, ep, NAP: tl.constexpr):
    """A poll's next round: ep after the nap (with NAP), and the words at ptrs1 and ptrs2 again."""
    if NAP:
        ep = _nap(ep)
    return ep, tl.load(ptrs1, mask=mask1, other=0, volatile=True), tl.load(ptrs2, mask=mask2, other=0, volatile=True)


@triton.jit
def await_words(ptrs1, mask1, ptrs2, mask2, ep, NAP: tl.constexpr):
    """The words at ptrs1 and ptrs2 (pack's or pack_pair's, which other programs write this step) once every
    masked word carries epoch ep: the reader polls the data itself, with no counter, fence or second load
    between a producer's store and its use; volatile loads bypass the SM's non-coherent L1. Both tensors are
    polled in one loop, so the pair costs one round trip to L2 (a poll's exit depends on its data, so two
    polls in turn would be serial); an item polls all the inputs it waits for at once (a residual slice that
    an input it polls already depends on is read with settled_words, outside the poll). With NAP it sleeps 100 ns
    between rounds."""
    p1 = tl.load(ptrs1, mask=mask1, other=0, volatile=True)
    p2 = tl.load(ptrs2, mask=mask2, other=0, volatile=True)
    if p1.numel <= WARP_REDUCED or p2.numel <= WARP_REDUCED:  # the warps vote (the module's docstring)
        stale = _agreed(_stale(p1, mask1, ep) + _stale(p2, mask2, ep))
        while stale > 0:  # the vote in the loop's body: in its condition, Triton 3.6's layout pass fails
            ep, p1, p2 = _reload(ptrs1, mask1, ptrs2, mask2, ep, NAP)
            stale = _agreed(_stale(p1, mask1, ep) + _stale(p2, mask2, ep))
    else:  # the test in the condition: computed in the body as above, 4- and 8-row steps spill 68-88 bytes more
        while _stale(p1, mask1, ep) + _stale(p2, mask2, ep) > 0:
            ep, p1, p2 = _reload(ptrs1, mask1, ptrs2, mask2, ep, NAP)
    return _fresh(p1, ptrs1, mask1, ep), _fresh(p2, ptrs2, mask2, ep)


@triton.jit
def await_words3(ptrs1, mask1, ptrs2, mask2, ptrs3, mask3, ep, NAP: tl.constexpr):
    """await_words of three tensors."""
    p1 = tl.load(ptrs1, mask=mask1, other=0, volatile=True)
    p2 = tl.load(ptrs2, mask=mask2, other=0, volatile=True)
    p3 = tl.load(ptrs3, mask=mask3, other=0, volatile=True)
    if p1.numel <= WARP_REDUCED or p2.numel <= WARP_REDUCED or p3.numel <= WARP_REDUCED:
        stale = _agreed(_stale(p1, mask1, ep) + _stale(p2, mask2, ep) + _stale(p3, mask3, ep))
        while stale > 0:
            ep, p1, p2 = _reload(ptrs1, mask1, ptrs2, mask2, ep, NAP)
            p3 = tl.load(ptrs3, mask=mask3, other=0, volatile=True)
            stale = _agreed(_stale(p1, mask1, ep) + _stale(p2, mask2, ep) + _stale(p3, mask3, ep))
    else:
        while _stale(p1, mask1, ep) + _stale(p2, mask2, ep) + _stale(p3, mask3, ep) > 0:
            ep, p1, p2 = _reload(ptrs1, mask1, ptrs2, mask2, ep, NAP)
            p3 = tl.load(ptrs3, mask=mask3, other=0, volatile=True)
    return _fresh(p1, ptrs1, mask1, ep), _fresh(p2, ptrs2, mask2, ep), _fresh(p3, ptrs3, mask3, ep)


@triton.jit
def await_both(ptrs1, mask1, ptrs2, mask2, ep, NAP: tl.constexpr):
    """The fp32 values of await_words' words."""
    p1, p2 = await_words(ptrs1, mask1, ptrs2, mask2, ep, NAP)
    return _value(p1), _value(p2)


@triton.jit
def await_three(ptrs1, mask1, ptrs2, mask2, ptrs3, mask3, ep, NAP: tl.constexpr):
    """The fp32 values of await_words3's words."""
    p1, p2, p3 = await_words3(ptrs1, mask1, ptrs2, mask2, ptrs3, mask3, ep, NAP)
    return _value(p1), _value(p2), _value(p3)


@triton.jit
def settled_words(ptrs, mask, ep):
    """The words at ptrs (pack's or pack_pair's) that an input this item has polled depends on (o_proj's and
    down's residual slice: every qkv or gate_up item polled the whole row before its output existed), so they
    carry epoch ep or soon will: one load, then each thread reloads only its own stale copies, without a poll
    round's reductions and barriers."""
    p = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return _fresh(p, ptrs, mask, ep)


@triton.jit
def settled(ptrs, mask, ep):
    """The fp32 values of settled_words' words."""
    return _value(settled_words(ptrs, mask, ep))
