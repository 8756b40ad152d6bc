"""Where a training batch's teacher signal comes from: the live target (online) or feature shards (offline).

Usage: source = OnlineSource(target, samples, cfg, used, t2d, device)
       embeds, features, teacher = source.prepare(source.stream.next())

Both sources turn a batch into the same three things, so the trainer cannot tell them apart: the
target's embeddings of the tokens, the fused features, and the teacher distributions over the draft
vocabulary. Offline recomputes the logits from the stored final hidden states with the LM head.
"""

from __future__ import annotations

import torch

from eyas.models.llama import CausalLM
from eyas.train.batches import Batch, BatchStream, collate_samples
from eyas.train.repeats import token_weights
from eyas.train.shards import FeatureStore
from eyas.train.target import TargetHeads, run_target
from eyas.train.ttt import Teacher, teacher_from_logits


class _Source:
    stream: BatchStream

    def __init__(self, used: torch.Tensor, t2d: torch.Tensor, device, repeat_weight: float = 1.0,
                 repeat_ngram: int = 8, teacher_temperature: float = 1.0):
        self.device = torch.device(device)
        self.used, self.t2d = used.to(self.device), t2d.to(self.device)
        self.repeat_weight, self.repeat_ngram = repeat_weight, repeat_ngram
        self.teacher_temperature = teacher_temperature

    def _teacher(self, logits: torch.Tensor, loss_mask: torch.Tensor, input_ids: torch.Tensor) -> Teacher:
        """logits: the LM head's output in the target's dtype. A float32 copy over the full vocabulary (6 GB at
        32k tokens x 49,152) is never made: the argmax is the same on the bf16 values, and only the draft
        vocabulary's columns are cast."""
        weight = None
        if self.repeat_weight != 1.0:
            weight = token_weights(input_ids, self.repeat_ngram, self.repeat_weight)
        return teacher_from_logits(logits, loss_mask, self.used, self.t2d, weight, self.teacher_temperature)


class OnlineSource(_Source):
    def __init__(self, target: CausalLM, samples, batch_tokens: int, seed: int, used, t2d, device, rank=0, world=1,
                 **weights):
        super().__init__(used, t2d, device, **weights)
        self.target = target
        self.stream = BatchStream([len(s) for s in samples], batch_tokens, seed, collate_samples(samples), rank, world)

    @torch.no_grad()
    def prepare(self, batch: Batch):
        b = batch.to(self.device)
        embeds, out = self.target_pass(b)
        return embeds, out.features, self.teacher(b, out)

    @torch.no_grad()
    def target_pass(self, b: Batch):
        """The target's embeddings of a batch on the device, and its forward (features, final hidden states)."""
        return self.target.embed(b.input_ids), run_target(self.target, b.input_ids)

    @torch.no_grad()
    def teacher(self, b: Batch, out) -> Teacher:
        return self._teacher(self.target.lm_head(out.hidden), b.loss_mask, b.input_ids)


class OfflineSource(_Source):
    def __init__(self, heads: TargetHeads, store: FeatureStore, batch_tokens: int, seed: int, used, t2d, device,
                 rank=0, world=1, **weights):
        super().__init__(used, t2d, device, **weights)
        self.heads = heads
        self.stream = BatchStream(store.lengths(), batch_tokens, seed, store.fetch, rank, world)

    @torch.no_grad()
    def prepare(self, batch: Batch):
        b = batch.to(self.device)
        dtype = self.heads.embed_weight.dtype
        return (self.heads.embed(b.input_ids), b.features.to(dtype),
                self._teacher(self.heads.logits(b.hidden.to(dtype)), b.loss_mask, b.input_ids))
