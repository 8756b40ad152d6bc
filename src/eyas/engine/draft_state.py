"""What the draft keeps per sequence between speculative cycles (DraftState), and the batch tensors read from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftState:
    """Row `row` of the draft pass that last ran for this sequence: its pre-norm output at position c-1
    (c - len(lag_tokens) while lagging) and its scores for x_{c+1}, whose log_softmax is its log-probabilities
    (Drafter.scores); and the plain-step pairs it has not seen yet (catch_up.py's lag). Rows stay in the pass's
    batched tensors, so a batch that runs together again is read back without a gather."""
    batch_hidden: torch.Tensor  # [n, H]
    batch_scores: torch.Tensor  # [n, draft_vocab]
    row: int
    lag_tokens: list = field(default_factory=list)  # tokens of plain steps the draft has not seen yet
    lag_feats: list = field(default_factory=list)   # their features: (plain step's [B, 3H] features, row)

    @property
    def hidden(self) -> torch.Tensor:
        return self.batch_hidden[self.row]

    @property
    def scores(self) -> torch.Tensor:
        return self.batch_scores[self.row]


def set_states(seqs, hidden: torch.Tensor, scores: torch.Tensor):
    for i, s in enumerate(seqs):
        s.draft_state = DraftState(hidden, scores, i)


def lag_features(seqs, L: int) -> torch.Tensor:
    """[n, L, 3H] the held-back features of `seqs`, zero rows after a shorter lag: one concatenation of
    the plain steps' feature tensors and one gather, however many sequences and steps."""
    offsets: dict[int, int] = {}
    sources, index, total = [], [], 0
    for s in seqs:
        for feats, row in s.draft_state.lag_feats:
            if id(feats) not in offsets:
                offsets[id(feats)] = total
                sources.append(feats)
                total += feats.shape[0]
            index.append(offsets[id(feats)] + row)
        index.extend([-1] * (L - len(s.draft_state.lag_feats)))  # padding: the zero row appended below
    if -1 in index:
        sources.append(torch.zeros_like(sources[0][:1]))
        index = [total if i < 0 else i for i in index]
    flat = torch.cat(sources) if len(sources) > 1 else sources[0]
    return flat[torch.tensor(index, device=flat.device)].view(len(seqs), L, -1)


def gather_states(seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, H], [B, V]) draft states of `seqs`: the pass's own tensors when the batch is that pass's rows
    in order (the steady state), else stacked row by row."""
    first = seqs[0].draft_state
    if first.batch_hidden.shape[0] == len(seqs) and all(
            s.draft_state.batch_hidden is first.batch_hidden and s.draft_state.row == i for i, s in enumerate(seqs)):
        return first.batch_hidden, first.batch_scores
    return (torch.stack([s.draft_state.hidden for s in seqs]), torch.stack([s.draft_state.scores for s in seqs]))
