"""Per-cycle phase timings: CUDA events on the GPU (resolved lazily, no sync in the loop), a monotonic
clock on the CPU; acceptance statistics per cycle."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch

PHASES = ("prefill", "decode", "draft", "verify", "accept", "commit")  # the order of table()'s rows


class Profiler:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending = []                  # (phase, start event, end event)
        self.times = defaultdict(list)     # phase -> [ms per cycle]
        self.accept_hist = Counter()       # tokens produced per sequence-cycle
        self.position_tries = Counter()    # draft position -> cycles that reached it
        self.position_hits = Counter()     # draft position -> cycles that accepted it
        self.cycles = 0
        self.tokens = 0

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.times[name].append((time.perf_counter() - t0) * 1e3)

    def record_accept(self, accepted: int, depth: int):
        """One sequence's cycle: `accepted` draft tokens taken out of a path of `depth` draft positions."""
        self.cycles += 1
        self.tokens += accepted + 1
        self.accept_hist[accepted + 1] += 1
        for pos in range(1, depth + 1):
            self.position_tries[pos] += 1
            if pos <= accepted:
                self.position_hits[pos] += 1

    def _resolve(self):
        if self.pending:
            torch.cuda.synchronize()
            for name, s, e in self.pending:
                self.times[name].append(s.elapsed_time(e))
            self.pending.clear()

    def drain(self) -> dict[str, list[float]]:
        """Phase times recorded since the last drain, then forgotten: a long-running server reads them per step."""
        self._resolve()
        out, self.times = dict(self.times), defaultdict(list)
        return out

    def summary(self) -> dict:
        self._resolve()
        phases = {}
        for name, vals in self.times.items():
            t = torch.tensor(vals)
            phases[name] = dict(count=len(vals), mean_ms=t.mean().item(), p50_ms=t.quantile(0.5).item(),
                                p90_ms=t.quantile(0.9).item())
        return dict(
            phases=phases,
            cycles=self.cycles,
            accept_length=self.tokens / self.cycles if self.cycles else 0.0,
            accept_histogram={k: self.accept_hist[k] for k in sorted(self.accept_hist)},
            accept_rate_by_position={p: self.position_hits[p] / self.position_tries[p] for p in sorted(self.position_tries)},
        )

    def table(self) -> str:
        s = self.summary()
        lines = [f"{'phase':<8} {'count':>6} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9}"]
        for name in PHASES:
            if name in s["phases"]:
                p = s["phases"][name]
                lines.append(f"{name:<8} {p['count']:>6} {p['mean_ms']:>9.3f} {p['p50_ms']:>9.3f} {p['p90_ms']:>9.3f}")
        if s["cycles"]:  # speculation to report on (plain decoding has none)
            lines.append(f"acceptance length {s['accept_length']:.3f} over {s['cycles']} sequence-cycles")
            lines.append("histogram " + " ".join(f"{k}:{v}" for k, v in s["accept_histogram"].items()))
            lines.append("accept rate by position "
                         + " ".join(f"{k}:{v:.2f}" for k, v in s["accept_rate_by_position"].items()))
        return "\n".join(lines)


class NullProfiler:
    @contextmanager
    def phase(self, name):
        yield

    def record_accept(self, accepted, depth):
        pass


NULL_PROFILER = NullProfiler()
