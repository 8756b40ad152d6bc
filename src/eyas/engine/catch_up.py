"""The draft's lag: the pairs that plain steps hold back, and the passes that catch the draft up on them.

When the speculation policy chooses a plain step (spec_policy.py) the draft does not run: each sequence keeps
the step's (target feature, token) pair in its lag (draft_state.py), and before the next speculative cycle
the draft runs over the whole batch's lags at once (or once LAG_FLUSH pairs have piled up), so speculation
can resume on any later step and plain steps cost what plain decoding costs.

With CUDA graphs the catch-up runs in passes of S+1 pairs through the extend graph that sampled cycles use
(the same shapes, captured at warm-up). One eager pass over the whole lag paid a first-time price for every
new (rows, lag) shape: 70-79 ms on an H200 with a tiny draft, ~1 s inside one adaptive window with SmolLM2's
(benchmarks/diagnose_catch_up.py, docs/BENCHMARKS.md, 2026-12-01), and rows and lags vary with the traffic.
Without graphs (the CPU) one eager pass does it.
"""

from __future__ import annotations

import torch

from eyas.engine.draft_state import lag_features, set_states
from eyas.engine.graphs import graph_kv_len

LAG_FLUSH = 256  # plain-step pairs a sequence may hold back from the draft before it is caught up anyway


def hold_back(seqs, features: torch.Tensor, rows):
    """A plain step's (feature, token) pair of each sequence goes to its lag: its last token, and its row
    of the step's features [rows, 3H] (a reference: no tensor op per sequence)."""
    for s, i in zip(seqs, rows):
        s.draft_state.lag_tokens.append(s.output_ids[-1])
        s.draft_state.lag_feats.append((features, i))


def catch_up(spec, seqs):
    """Run the draft of `spec` (a SpeculativeDecoder) over the pairs these sequences hold back."""
    if not seqs:
        return
    if spec.graphs is not None:
        in_graphed_passes(spec, seqs)
    else:
        in_one_eager_pass(spec, seqs)


def in_graphed_passes(spec, seqs):
    """Pass j feeds pairs j*L.. (L = S+1) of every row that still has some, padded at the end as a sampled
    cycle's accepted path is: the pads write draft cache columns below c - 1 + S, inside the lookahead
    admission reserved, which the next draft overwrites before reading. Each row keeps the state of the
    pass that held its last pair."""
    dev, L = spec.engine.device, spec.spec.steps + 1
    lags = [list(s.draft_state.lag_tokens) for s in seqs]  # set_states (in _extend) starts each row afresh
    most = max(len(t) for t in lags)
    feats = lag_features(seqs, -(-most // L) * L)  # [n, passes * L, 3H], zeros past each lag
    for j in range(0, most, L):
        rows = [i for i, t in enumerate(lags) if len(t) > j]
        group = [seqs[i] for i in rows]
        pieces = [lags[i][j:j + L] for i in rows]
        first = [s.cached - len(lags[i]) + j for s, i in zip(group, rows)]
        meta = torch.tensor([p + [0] * (L - len(p)) + [f, s.slot, len(p) - 1]
                             for p, f, s in zip(pieces, first, group)], device=dev)  # one copy
        spec._extend(group, meta[:, :L], meta[:, L + 2], feats[rows, j:j + L], meta[:, L], meta[:, L + 1], max(first))


def in_one_eager_pass(spec, seqs):
    """Shorter lags are padded at their end (the pads write draft cache columns past the sequence, which
    nothing reads before the next draft overwrites them). A row whose padding would run past the end of its
    cache row goes in a pass of its own lag length instead."""
    dev, kv = spec.engine.device, spec.kv
    L = max(len(s.draft_state.lag_tokens) for s in seqs)
    groups: dict[int, list] = {}  # L: padded to the longest lag; -n: exactly n, no padding
    for s in seqs:
        n = len(s.draft_state.lag_tokens)
        groups.setdefault(L if s.cached - n + L <= kv.max_len else -n, []).append(s)
    for key, group in groups.items():
        L = abs(key)
        lens = [len(s.draft_state.lag_tokens) for s in group]
        ids = torch.tensor([s.draft_state.lag_tokens + [0] * (L - n) for s, n in zip(group, lens)], device=dev)
        feats = lag_features(group, L)
        first = [s.cached - n for s, n in zip(group, lens)]
        meta = torch.tensor([first, [s.slot for s in group], [n - 1 for n in lens]], device=dev)
        h, logp = spec.drafter.extend(ids, feats, meta[2], meta[0], meta[1], graph_kv_len(kv, max(first) + L))
        set_states(group, h, logp)
