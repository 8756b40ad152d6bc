"""The draft's passes over the draft KV cache: extending it over committed pairs, and drafting a candidate
tree from the last committed position, as a chain (topk 1) or EAGLE-2's dynamic tree.

All are tensor-only with fixed shapes, so the speculative decoder (speculative.py) can capture them in CUDA
graphs. Drafting reads the draft's output at position c-1 (its scores scores0, see Drafter.scores, and its
hidden state hidden0) and writes draft cache columns from c on, which the commit's extend pass then
overwrites with the accepted pairs.
"""

from __future__ import annotations

import torch

from eyas.engine.persistent_draft import PersistentDraft
from eyas.layers.attention import AttentionBatch
from eyas.layers.draft_tree import DraftPool, expand_frontier, select_tree
from eyas.layers.topk import argmax, topk
from eyas.models.eagle3 import step_fusions


class Drafter:
    def __init__(self, draft, embedding, kv, spec, device):
        """embedding: the target's token embedding module (target ids -> rows)."""
        self.draft, self.embed, self.kv, self.spec = draft, embedding, kv, spec
        self.persistent = PersistentDraft(draft, embedding, kv, device) if spec.topk == 1 else None
        if spec.topk == 1:  # a chain's tree never changes: the root, then one node per step, each its parent's child
            n = spec.draft_tokens
            self.chain_tree = (torch.arange(-1, n - 1, device=device)[None], torch.arange(n, device=device)[None],
                               torch.ones(n, n, dtype=torch.bool, device=device).tril()[None])
        # What never changes in a tree's pool, made once instead of a launch per cycle in its graph.
        k = spec.topk
        self.pool_depth = torch.tensor([1] * k + [d for d in range(2, spec.steps + 1) for _ in range(k * k)],
                                       device=device)[None]
        self.first_frontier = torch.arange(k, device=device)[None]
        self.eye = torch.eye(k, dtype=torch.bool, device=device)[None]

    def forward(self, embeds, hidden, positions, slots, starts, kv_len, fuse=False, new_mask=None, visible=None):
        batch = AttentionBatch(kv=self.kv, slots=slots, starts=starts, kv_len=kv_len, new_mask=new_mask,
                               visible=visible)
        return self.draft(embeds, hidden, positions, batch, fuse=fuse)

    def extend(self, ids, feats, last, starts, slots, kv_len):
        """Draft over (feature, next token) pairs at positions starts..starts+L; returns the output at `last`."""
        L = ids.shape[1]
        pos = starts[:, None] + torch.arange(L, device=ids.device)[None]
        out = self.forward(self.embed(ids), feats, pos, slots, starts, kv_len, fuse=True)
        h = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        return h, self.scores(h)

    def scores(self, h):
        """The draft's next-token scores at its output h, kept in the DraftState: with step fusions on, the
        head's logits as they come (the chain argmaxes them, the tree's top-k kernel normalises them: two
        launches fewer per cycle), else fp32 log-probs. Either way their log_softmax is the draft's log-probs."""
        if step_fusions():
            return self.draft.head_output(h)
        return torch.log_softmax(self.draft.logits(h), dim=-1)

    def chain(self, scores0, hidden0, root, c, slots, kv_len):
        """A chain (topk 1): each step feeds its argmax to the next, and the draft attends causally over its
        cache. The same tree as tree()'s with k = 1 (up to which of two exactly tied tokens is guessed),
        without the small kernels of its scores, frontier and reranking."""
        ids = argmax(scores0)[:, None]                                       # [B, 1] draft ids
        hidden, guesses = hidden0[:, None], [ids]
        B = root.shape[0]
        persistent = self.persistent.serves(B, kv_len)
        for step in range(2, self.spec.steps + 1):
            start = c + (step - 2) if step > 2 else c                        # the position and the column
            if persistent:  # the whole step as one launch (persistent_draft.py)
                ids, hidden = self.persistent.step(step, ids, hidden, start, slots)
            else:
                out = self.forward(self.draft.embed_ids(ids, self.embed), hidden, start[:, None], slots, start, kv_len)
                ids, hidden = argmax(self.draft.head_output(out)), out
            guesses.append(ids)
        tokens = torch.cat([root[:, None], self.draft.to_target_ids(torch.cat(guesses, dim=1))], dim=1)
        parents, depth, mask = self.chain_tree
        return tokens, parents.expand(B, -1), depth.expand(B, -1), mask.expand(B, -1, -1)

    def tree(self, scores0, hidden0, root, c, slots, kv_len):
        """EAGLE-2 dynamic tree: expand the top-k frontier by cumulative log-prob for S steps, then rerank."""
        S, k, N = self.spec.steps, self.spec.topk, self.spec.draft_tokens
        dev, B, P = root.device, root.shape[0], self.pool_depth.shape[1]
        hidden = hidden0[:, None].expand(B, k, -1)
        scores, ids = topk(scores0, k, log_softmax=True)                     # [B, k] log-probs
        pool = DraftPool(torch.empty((B, P), dtype=torch.long, device=dev),
                         torch.empty((B, P), dtype=scores.dtype, device=dev),
                         torch.empty((B, P), dtype=torch.long, device=dev))
        pool.tokens[:, :k], pool.scores[:, :k], pool.parents[:, :k] = ids, scores, -1
        frontier = self.first_frontier.expand(B, k)                         # pool index of each frontier node
        mask = self.eye.expand(B, k, k)                                     # over drafted columns so far
        for step in range(2, S + 1):
            embeds = self.draft.embed_ids(ids, self.embed)
            pos, start = (c + (step - 2), c + (step - 2) * k) if step > 2 else (c, c)
            out = self.forward(embeds, hidden, pos[:, None].expand(B, k), slots, start, kv_len, new_mask=mask,
                               visible=c)
            child_scores, child_ids = topk(self.draft.head_output(out), k, log_softmax=True)
            scores, ids, hidden, frontier, mask = expand_frontier(pool, k + (step - 2) * k * k, scores, child_scores,
                                                                  child_ids, frontier, out, mask)
        tree = select_tree(root, pool.tokens, pool.scores, pool.parents, self.pool_depth.expand(B, -1), N, S)
        tokens = torch.cat([tree.tokens[:, :1], self.draft.to_target_ids(tree.tokens[:, 1:])], dim=1)
        return tokens, tree.parents, tree.depth, tree.mask
