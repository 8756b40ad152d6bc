"""The target's embedding rows of draft-vocabulary ids, in one launch.

The EAGLE-3 draft proposes ids in its own reduced vocabulary; each drafting step feeds them back as the
target's token embeddings, of target id = draft id + d2t[draft id]. In torch that is a gather of d2t, an add
and the embedding lookup: three launches per step at batch 1, where launches are the cost. Here one program
copies one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _draft_embed_kernel(ids_ptr, d2t_ptr, table_ptr, out_ptr, H, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    i = tl.program_id(0).to(tl.int64)
    draft_id = tl.load(ids_ptr + i)
    target_id = draft_id + tl.load(d2t_ptr + draft_id)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    tl.store(out_ptr + i * H + cols, tl.load(table_ptr + target_id * H + cols, mask=mask), mask=mask)


def draft_embed(ids: torch.Tensor, d2t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids + d2t[ids]]: ids [...] (int64) of the draft vocabulary, d2t [draft vocab] its offsets to target
    ids, table [target vocab, H] the target's embedding. Returns [..., H] in the table's dtype."""
    if ids.dtype != torch.long or d2t.dtype != torch.long or table.dim() != 2:
        raise ValueError(f"draft_embed: ids {ids.dtype} and d2t {d2t.dtype} must be int64 and the table 2-D, "
                         f"got {tuple(table.shape)}")
    h = table.shape[1]
    out = torch.empty((*ids.shape, h), dtype=table.dtype, device=table.device)
    n = ids.numel()
    if n:
        _draft_embed_kernel[(n,)](ids.contiguous(), d2t.contiguous(), table.contiguous(), out, h,
                                  BLOCK=triton.next_power_of_2(h), **pdl_args(ids))
    return out
