"""A chain draft's steps as one persistent kernel launch each (eyas.kernels.persistent_decode's draft form),
where the plan asks.

A chain (topk 1) drafts one token a step from one sequence: the midlayer (two input norms, q/k/v, rotary,
attention over the draft cache, o_proj, the MLP), the draft's norm and LM head and the argmax over its
vocabulary, about ten small kernels, become one launch. The ids it reads are draft ids, mapped to the target's
embedding inside the kernel; it writes the step's output state (the next step's hidden input) and its argmax.
Each step of a cycle has a PersistentStep of its own, so one step's outputs stay valid while the next reads
them, with no copy. Other drafts, batches, trees and longer caches keep the draft's own path.
"""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.engine.persistent import MAX_COLUMNS, REGISTER_TILE_BYTES, largest_tile
from eyas.kernels import switched_on
from eyas.kernels.persistent_schedule import Tiles


LM_HEAD_ITEMS = 128  # a draft's LM-head tiles: about one per SM of an H100 (132), not a few long ones
LM_BLOCK = 32        # rows an LM-head item multiplies at a time (PersistentStep's block_l)


def draft_tiles(cfg, element_size: int) -> Tiles | None:
    """The largest tiles (powers of two up to the target's 16) whose weight tiles fit what one program holds in
    registers: a draft's q/k/v tile reads 2H columns, and its MLP is often wider than its target's. Its small
    vocabulary is cut into about LM_HEAD_ITEMS tiles, so every program shares the head. None where even 2-row
    tiles do not fit."""
    h, e = cfg.hidden_size, element_size
    qkv = largest_tile(4 * h * e, min(16, cfg.head_dim // 2))  # a rotation pair's two rows, each 2H wide
    # A 1-row gate/up item may hold twice the bytes: the bundled draft's 32-row tiles (72 KB in bf16, its 2,816-wide
    # MLP in 88 items, one round over an H100's SMs, not two) compile without a spill and took 5% less a step
    # than 16 in two runs; q/k/v and down at twice the bytes were level, so they keep the rule.
    gate_up = largest_tile(2 * h * e, 32, 2 * REGISTER_TILE_BYTES)
    tiles = Tiles(qkv=qkv, o_proj=largest_tile(cfg.num_heads * cfg.head_dim * e), gate_up=gate_up,
                  down=largest_tile(cfg.intermediate_size * e),
                  lm_head=-(-cfg.draft_vocab_size // (LM_HEAD_ITEMS * LM_BLOCK)) * LM_BLOCK)
    return tiles if min(tiles.qkv, tiles.o_proj, tiles.gate_up, tiles.down) >= 2 else None


class PersistentDraft:
    """One launch per chain draft step of one sequence, a PersistentStep per step of the cycle, built on demand."""

    def __init__(self, draft, embedding, kv, device):
        self.kv, self.device = kv, torch.device(device)
        self.packed, self.tiles, self.steps = None, None, {}
        if switched_on(torch.empty(0, device=device)):  # CUDA, or the interpreter in tests
            from eyas.kernels.persistent_step import draft_unsupported  # imports Triton

            if draft_unsupported(draft, embedding) is None:
                self.tiles = draft_tiles(draft.config, draft.lm_head.weight.element_size())
        self.eligible = self.tiles is not None
        if self.eligible and execution_plan.current().persistent_draft:
            from eyas.kernels.persistent_step import pack_eagle3

            self.packed = pack_eagle3(draft, embedding)
            self.depth = torch.zeros(1, dtype=torch.long, device=device)
            self.causal = torch.ones(1, 1, dtype=torch.bool, device=device)

    def serves(self, rows: int, kv_len: int) -> bool:
        """Whether a chain step of `rows` sequences (padded to its graph bucket) over a draft cache of up to
        kv_len columns runs here."""
        return self.packed is not None and rows == 1 and kv_len <= MAX_COLUMNS

    def _step(self, index: int):
        from eyas.kernels.persistent_step import PersistentStep

        step = self.steps.get(index)
        if step is None:
            dev = self.device
            programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
            step = self.steps[index] = PersistentStep(self.packed, 1, programs, self.tiles, block_l=LM_BLOCK)
        return step

    def step(self, index: int, ids: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain step `index` of a cycle: draft ids [1, 1] and the hidden input [1, 1, H] at column start[0] of
        slots[0] (device tensors). Returns (the argmax [1, 1], the output state [1, 1, H]): the step's own
        buffers, valid until this step's next launch."""
        return self.launch(self._step(index), ids, hidden, start, slots)

    def launch(self, step, ids: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step through `step`, a PersistentStep of this draft's packed weights (step()'s, or one with
        other tiles: benchmarks/bench_persistent_draft.py), with step()'s arguments and returns."""
        H = self.packed.shape.hidden
        step.launch(ids.reshape(1).contiguous(), start[:1], slots[:1], self.depth, self.causal, self.kv.k, self.kv.v,
                    hidden.reshape(1, H).contiguous())
        return step.tokens.view(1, 1), step.features.view(1, 1, H)
