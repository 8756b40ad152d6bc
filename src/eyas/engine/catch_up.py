"""The draft's lag: the pairs that plain steps hold back, and the passes that catch the draft up on them.

When the speculation policy chooses a plain step (spec_policy.py) the draft does not run: each sequence keeps
the step's (target feature, token) pair in its lag (draft_state.py), and before the next speculative cycle
the draft runs over the whole batch's lags at once (or once LAG_FLUSH pairs have piled up), so speculation
can resume on any later step and plain steps cost what plain decoding costs.

With CUDA graphs the catch-up runs through extend graphs captured at warm-up, never a new shape in traffic
(an eager pass pays a first-time price for every new (rows, lag) shape, and rows and lags vary with the
traffic). Passes are WIDE columns wide (the graphed prefill chunk's width; warm_wide_passes captures them for
every batch bucket) while more than S+1 pairs remain and every row's pass fits in its cache row, else S+1 wide
(the sampled cycle's extend graph): a draft pass costs about the same at 4 columns as at 64
(benchmarks/bench_adaptive_plain.py). Without graphs (the CPU) one eager pass does it.
"""

from __future__ import annotations

import torch

from eyas.engine.draft_state import lag_features, set_states
from eyas.engine.graphs import BATCH_BUCKETS, graph_kv_len
from eyas.engine.runner import PREFILL_CHUNK

LAG_FLUSH = 256  # plain-step pairs a sequence may hold back from the draft before it is caught up anyway
WIDE = PREFILL_CHUNK  # columns of a wide catch-up pass (the same graphs as the draft's graphed prefill chunks)


def hold_back(seqs, features: torch.Tensor, rows):
    """A plain step's (feature, token) pair of each sequence goes to its lag: its last token, and its row
    of the step's features [rows, 3H] (a reference: no tensor op per sequence)."""
    for s, i in zip(seqs, rows):
        s.draft_state.lag_tokens.append(s.output_ids[-1])
        s.draft_state.lag_feats.append((features, i))


def catch_up(decoder, seqs):
    """Run the draft of `decoder` (a SpeculativeDecoder) over the pairs these sequences hold back."""
    if not seqs:
        return
    if decoder.graphs is not None:
        in_graphed_passes(decoder, seqs)
    else:
        in_one_eager_pass(decoder, seqs)


def in_graphed_passes(decoder, seqs):
    """Pass after pass over the pairs j.. of every row that still has some, WIDE or S+1 of them (as the module
    docstring says). Shorter pieces are padded at their end as a sampled cycle's accepted path is: the pads
    write draft cache columns past the row's last pair, which the next draft overwrites before reading. Each
    row keeps the state of the pass that held its last pair."""
    dev, L, kv = decoder.engine.device, decoder.spec.steps + 1, decoder.kv
    wide_shapes = [(WIDE,), (WIDE, feature_width(decoder)), (), (), ()]  # per row: ids, feats, last, starts, slots
    lags = [list(s.draft_state.lag_tokens) for s in seqs]  # set_states (in extend) starts each row afresh
    passes, j = [], 0
    while True:
        rows = [i for i, t in enumerate(lags) if len(t) > j]
        if not rows:
            break
        first = [seqs[i].cached - len(lags[i]) + j for i in rows]
        wide = (max(len(lags[i]) for i in rows) - j > L and max(first) + WIDE <= kv.max_len
                and decoder.has_graph("extend", len(rows), kv, max(first) + WIDE, wide_shapes))
        width = WIDE if wide else L
        passes.append((j, width, rows, first))
        j += width
    feats = lag_features(seqs, j)  # [n, columns of all passes, 3H], zeros past each lag
    for j, width, rows, first in passes:
        group = [seqs[i] for i in rows]
        pieces = [lags[i][j:j + width] for i in rows]
        meta = torch.tensor([p + [0] * (width - len(p)) + [f, s.slot, len(p) - 1]
                             for p, f, s in zip(pieces, first, group)], device=dev)  # one copy
        decoder.extend(group, meta[:, :width], meta[:, width + 2], feats[rows, j:j + width], meta[:, width],
                       meta[:, width + 1], max(first))


def feature_width(decoder) -> int:
    """Width of a target feature: the captured layers' hidden states side by side (3H for EAGLE-3)."""
    return len(decoder.target.capture_layers) * decoder.target.config.hidden_size


def warm_wide_passes(decoder, max_batch: int) -> None:
    """Capture the WIDE-column extend graphs of the catch-up for every batch bucket up to max_batch and every
    kv bound a pass may need (graph_kv_len: two with the slot-attention kernel, doubling buckets without), on
    the pad slot only: dummy rows whose writes land where pad rows' do. Without them the catch-up takes
    S+1-wide passes only."""
    dev, kv = decoder.engine.device, decoder.kv
    scratch, dtype = decoder.engine.runner.scratch_slot, next(decoder.draft.parameters()).dtype
    needs = {}  # kv bound -> the fewest columns that need it
    for need in range(WIDE, kv.max_len + 1):
        needs.setdefault(graph_kv_len(kv, need), need)
    for b in (b for b in BATCH_BUCKETS if b <= max_batch):
        for need in needs.values():
            ids = torch.zeros(b, WIDE, dtype=torch.long, device=dev)
            feats = torch.zeros(b, WIDE, feature_width(decoder), dtype=dtype, device=dev)
            last = torch.zeros(b, dtype=torch.long, device=dev)
            starts = torch.full((b,), need - WIDE, dtype=torch.long, device=dev)
            slots = torch.full((b,), scratch, dtype=torch.long, device=dev)
            decoder.run_padded("extend", decoder.drafter.extend, b, kv, need, [ids, feats, last, starts, slots],
                               [0, 0, 0, 0, scratch])


def in_one_eager_pass(decoder, seqs):
    """Shorter lags are padded at their end (the pads write draft cache columns past the sequence, which
    nothing reads before the next draft overwrites them). A row whose padding would run past the end of its
    cache row goes in a pass of its own lag length instead."""
    dev, kv = decoder.engine.device, decoder.kv
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
        h, scores = decoder.drafter.extend(ids, feats, meta[2], meta[0], meta[1], graph_kv_len(kv, max(first) + L))
        set_states(group, h, scores)
