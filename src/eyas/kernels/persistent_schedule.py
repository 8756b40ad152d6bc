"""The work-item schedule of a persistent (one-launch) decoder step for Llama-family targets.

A persistent kernel runs one step of the whole decoder as a single launch: each program (one per SM) pulls
work items from its own queue and runs them in order; an item that needs another's output waits on a
dependency counter instead of a kernel boundary, and every item bumps one counter when it is done. This
module is that schedule as data, with no torch and no GPU: the items of one step (a plain decode row, a
verify of up to 8 rows, a prefill), the counters they wait on and signal, how they are dealt to W programs,
and a check that a dealing can never deadlock. `persistent_reference` runs the same items in plain torch in
any order the counters allow, so CPU tests prove the dependencies complete before a GPU kernel uses them.

Items of one layer l, in the order their data flows (tiles cut output columns; every item of a layer that
writes a tile of a buffer is the only writer of those columns):
  attn_norm(l)      x = rmsnorm(h)                                   waits on every down(l-1) tile
  qkv(l, g)         q/k/v of kv-head group g, rotary, cache write    waits on attn_norm(l)
  attend(l, g)      attention of group g's query heads               waits on qkv(l, g)
  o_proj(l, j)      h[:, tile j] += attn @ Wo[tile j]^T              waits on every attend(l, *)
  mlp_norm(l)       x = rmsnorm(h)                                   waits on every o_proj(l, *) tile
  gate_up(l, j)     act[:, tile j] = silu(x Wg^T) * (x Wu^T)         waits on mlp_norm(l)
  down(l, j)        h[:, tile j] += act @ Wd[tile j]^T               waits on every gate_up(l, *) tile
then final_norm, lm_head(j) over vocabulary tiles, and argmax over every lm_head tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_ROWS = 8  # a plain step is 1 row; a verify up to 8; a prefill any number (the schedule does not depend on it)


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions the schedule is cut from (one tensor-parallel rank: TP > 1 keeps today's path)."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int

    def __post_init__(self):
        if min(self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.layers,
               self.vocab) <= 0:
            raise ValueError(f"every dimension must be positive: {self}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads do not split into {self.kv_heads} key/value groups")


@dataclass(frozen=True)
class Tiles:
    """Output columns per item of each projection (the unit a program streams and computes)."""
    o_proj: int = 64
    gate_up: int = 128
    down: int = 64
    lm_head: int = 4096


@dataclass(frozen=True)
class WorkItem:
    index: int
    op: str
    layer: int          # -1 for the items after the last layer
    part: int           # the group or tile index within the op (0 where the op has one item)
    cols: tuple[int, int]  # the output columns it writes: head group range for qkv/attend, else a tile
    wait: int | None    # the counter it waits on, None for the first item of a step
    wait_count: int     # the value that counter must reach
    signal: int         # the counter it bumps by one when done


@dataclass
class Schedule:
    shape: DecoderShape
    tiles: Tiles
    items: list[WorkItem] = field(default_factory=list)
    counters: list[str] = field(default_factory=list)

    def counter(self, name: str) -> int:
        self.counters.append(name)
        return len(self.counters) - 1


def _tiles(total: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, total)) for s in range(0, total, size)]


def build_schedule(shape: DecoderShape, tiles: Tiles = Tiles()) -> Schedule:
    """Every item of one step, in an order that respects every dependency (a valid order for one program)."""
    s = Schedule(shape, tiles)
    groups = shape.kv_heads
    o_tiles, gu_tiles = _tiles(shape.hidden, tiles.o_proj), _tiles(shape.intermediate, tiles.gate_up)
    down_tiles, lm_tiles = _tiles(shape.hidden, tiles.down), _tiles(shape.vocab, tiles.lm_head)

    def add(op, layer, part, cols, wait, wait_count, signal):
        s.items.append(WorkItem(len(s.items), op, layer, part, cols, wait, wait_count, signal))

    prev_down, prev_count = None, 0
    for layer in range(shape.layers):
        normed, attended = s.counter(f"attn_norm[{layer}]"), s.counter(f"attend[{layer}]")
        projected, mlp_normed = s.counter(f"o_proj[{layer}]"), s.counter(f"mlp_norm[{layer}]")
        activated, down = s.counter(f"gate_up[{layer}]"), s.counter(f"down[{layer}]")
        add("attn_norm", layer, 0, (0, shape.hidden), prev_down, prev_count, normed)
        for g in range(groups):
            qkv_done = s.counter(f"qkv[{layer},{g}]")
            add("qkv", layer, g, (g, g + 1), normed, 1, qkv_done)
            add("attend", layer, g, (g, g + 1), qkv_done, 1, attended)
        for j, cols in enumerate(o_tiles):
            add("o_proj", layer, j, cols, attended, groups, projected)
        add("mlp_norm", layer, 0, (0, shape.hidden), projected, len(o_tiles), mlp_normed)
        for j, cols in enumerate(gu_tiles):
            add("gate_up", layer, j, cols, mlp_normed, 1, activated)
        for j, cols in enumerate(down_tiles):
            add("down", layer, j, cols, activated, len(gu_tiles), down)
        prev_down, prev_count = down, len(down_tiles)
    final, logits, done = s.counter("final_norm"), s.counter("lm_head"), s.counter("argmax")
    add("final_norm", -1, 0, (0, shape.hidden), prev_down, prev_count, final)
    for j, cols in enumerate(lm_tiles):
        add("lm_head", -1, j, cols, final, 1, logits)
    add("argmax", -1, 0, (0, shape.vocab), logits, len(lm_tiles), done)
    return s


def deal(schedule: Schedule, programs: int) -> list[list[int]]:
    """Each program's queue: items dealt round-robin in schedule order, as a persistent kernel's programs
    take them. Any dealing that keeps each queue in schedule order cannot deadlock (see check_no_deadlock)."""
    if programs <= 0:
        raise ValueError("a persistent kernel needs at least one program")
    queues: list[list[int]] = [[] for _ in range(programs)]
    for item in schedule.items:
        queues[item.index % programs].append(item.index)
    return queues


def ready(item: WorkItem, counts: list[int]) -> bool:
    return item.wait is None or counts[item.wait] >= item.wait_count


def check_no_deadlock(schedule: Schedule, queues: list[list[int]]) -> None:
    """Raise if programs running their queues in order, each blocking at an item until its counter is
    reached, can stall with work left (a program spins on a counter that only work queued behind it bumps)."""
    dealt = sorted(i for q in queues for i in q)
    if dealt != list(range(len(schedule.items))):
        raise ValueError("the queues must hold every item of the schedule exactly once")
    counts, heads, left = [0] * len(schedule.counters), [0] * len(queues), len(dealt)
    while left:
        progressed = False
        for p, queue in enumerate(queues):
            while heads[p] < len(queue) and ready(schedule.items[queue[heads[p]]], counts):
                counts[schedule.items[queue[heads[p]]].signal] += 1
                heads[p] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = [schedule.items[q[h]] for q, h in zip(queues, heads) if h < len(q)]
            first = stuck[0]
            raise RuntimeError(f"deadlock: {len(stuck)} programs wait, e.g. {first.op}({first.layer}, "
                               f"{first.part}) on {schedule.counters[first.wait]} = {first.wait_count}")
