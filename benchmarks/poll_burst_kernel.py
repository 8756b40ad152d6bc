"""The kernel of bench_poll_burst: one producer program stores N epoch-tagged words, the others poll them with
the persistent step's own poll and stamp %globaltimer when all have arrived. Imported once TRITON_INTERPRET is
set (the CPU smoke test runs Triton's interpreter)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from eyas.kernels.persistent_words import INTERPRETED, await_both, packed


@triton.jit
def _now():
    if INTERPRETED:
        return tl.zeros((), tl.int64)
    else:
        return globaltimer()


@triton.jit(do_not_specialize=["n", "ep", "delay_ns"])
def burst_kernel(words, stamps, sink, n, ep, delay_ns, HALF: tl.constexpr, NAP: tl.constexpr):
    """Program 0 waits delay_ns, stores words[i] = i + ep tagged with epoch ep (i < n, in two blocks of HALF)
    and stamps; every other program awaits all n words, stamps, and stores their sum in sink."""
    pid = tl.program_id(0)
    a = tl.arange(0, HALF)
    m1 = a < n
    m2 = a + HALF < n
    if pid == 0:
        t0 = _now()
        t = t0
        while t - t0 < delay_ns:  # the interpreter's clock stays at 0: no delay
            t = _now() + INTERPRETED * delay_ns
        tl.store(words + a, packed((a + ep).to(tl.float32), ep), mask=m1)
        tl.store(words + HALF + a, packed((a + HALF + ep).to(tl.float32), ep), mask=m2)
        tl.store(stamps, _now())
    else:
        x1, x2 = await_both(words + a, m1, words + HALF + a, m2, ep, NAP)
        tl.store(stamps + pid, _now())
        tl.store(sink + pid, tl.sum(x1) + tl.sum(x2))  # the values were read, and are this launch's
