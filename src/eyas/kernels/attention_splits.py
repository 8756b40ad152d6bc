"""How slot attention divides a row's cache columns: the cache block of its loop, the split count a launch may
use (choose_splits) and the row length up to which a row runs in one pass anyway (one_pass_columns). Host-side
choices from shapes alone, so a captured graph keeps them; slot_attention.py runs the kernel, whose keywords
block_n, split_cols and one_pass_cols override these defaults for timing (benchmarks/bench_slot_attention.py)."""

from __future__ import annotations

import triton

from eyas import execution_plan


def attention_block_n(head_dim: int) -> int:
    """Cache columns per loop step: 64 (32 past a head dim of 128)."""
    return 64 if head_dim <= 128 else 32


def check_columns(name: str, value: int) -> int:
    """value, if it is a power of two from 16 (a tile keyword of slot_attention), else a ValueError."""
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value!r} is not a power of two from 16")
    return value


SPLIT_COLUMNS = 64  # columns per split at least, of a row that the kernel splits itself (with MERGE)
# 64 since the merge loads every split's partials at once: in SmolLM2's decode and verify steps 64 was faster
# than 128 (bench_step_ab.py, graph replays side by side), and the 8B-shaped step did not change.


def one_pass_columns(head_dim: int) -> int:
    """Rows up to this many columns run in one pass even in a split launch (with MERGE): below it a split's
    partial stores and merge cost more than the blocks they save. The kernel timed alone
    (benchmarks/bench_slot_attention.py) favours one pass up to a few hundred columns, but whole SmolLM2 steps
    (bench_step_ab.py, graph replays side by side) were faster splitting every row past SPLIT_COLUMNS at head
    dim 64; head dim 128 keeps 192, not timed in whole steps."""
    return SPLIT_COLUMNS if head_dim <= 64 else 192


def choose_splits(programs: int, columns: int, split_cols: int = SPLIT_COLUMNS) -> int:
    """Column splits per row, for `programs` (batch x kv heads x row blocks) over rows of up to `columns`:
    enough programs for ~128 SMs, each split keeping at least twice split_cols (128) of a long row
    (> 512 columns) and split_cols of a short one. With the merge in the kernel this is an upper bound:
    each row takes its own count from its length (one_pass_columns, split_cols). The plan's
    short_row_splits=False (eyas.execution_plan) launches rows of up to 512 columns in one pass."""
    if columns <= 512:
        if not execution_plan.current().short_row_splits:
            return 1
        return max(1, min(triton.cdiv(128, programs), columns // split_cols, 16))
    return max(1, min(triton.cdiv(128, programs), columns // (2 * split_cols), 16))


MERGE_UNROLL_VALUES = 32768  # partial-accumulator values (splits x rows x head dim) up to which the merge is unrolled


def merge_unrolled(splits: int, block_m: int, head_dim: int) -> bool:
    """Whether the split merge loads every split's partials at once (its loops unrolled) rather than one
    split after the other. At once is faster while they fit in registers: for the 8B shape it shortened a
    decode and a 4-token verify step (16 splits x 16 rows x 128 = 32,768 values) and lengthened an 8-token
    verify (16 x 32 x 128) by 8% (bench_step_ab.py)."""
    return splits * block_m * head_dim <= MERGE_UNROLL_VALUES
