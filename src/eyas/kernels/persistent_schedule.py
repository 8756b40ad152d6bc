"""The work-item schedule of a persistent (one-launch) decoder step for Llama-family targets.

A persistent kernel runs one step of the whole decoder as a single launch: each program (one per SM) pulls
work items from its own queue and runs them in order; an item that needs another's output waits on a
dependency counter instead of a kernel boundary, and every item bumps one counter when it is done. This
module is that schedule as data, with no torch and no GPU: the items of one step (a plain decode row, a
verify of up to 8 rows, a prefill), the counters they wait on and signal, how they are dealt to W programs,
and a check that a dealing can never deadlock. `persistent_reference` runs the same items in plain torch in
any order the counters allow, so CPU tests prove the dependencies complete before a GPU kernel uses them.

Items of one layer l, in the order their data flows. A stage's items run at once on different programs, so
a stage is cut into many small items (each streams a few tens of KB of weights), and the RMS norms ride in
their consumers (each item normalizes the few rows it reads) instead of costing a stage of their own:
  qkv(l, j)       a rotation pair of one head's rows of the fused q/k/v projection: T rows of the head's
                  first half and their T partners in the second, so rotary is applied in place; normalizes
                  the stream entering the layer (the embeddings at layer 0); q to a buffer, k/v to the cache
                                                                    waits on every down(l-1) tile
  attend(l, h, s) attention of query head h over split s of the cache (the step's columns cut in
                  attend_splits equal runs, so a long context spreads over programs too): the split's
                  running maximum, sum and unnormalized output     waits on every qkv(l, *) item
  o_proj(l, j)    h[:, tile j] += attn @ Wo[tile j]^T, attn merged from the splits  waits on every attend(l, *)
  gate_up(l, j)   act[:, tile j] = silu(x Wg^T) * (x Wu^T), x the normed stream  waits on every o_proj(l, *)
  down(l, j)      h[:, tile j] += act @ Wd[tile j]^T                 waits on every gate_up(l, *) tile
then lm_head(j) over vocabulary tiles (with the final norm, and each tile's own maximum and its index), and
argmax over the tiles' maxima.
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
        if self.head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, not {self.head_dim}")


@dataclass(frozen=True)
class Tiles:
    """Output rows per item of each projection (the unit a program streams and computes). qkv is the size of
    each half of a rotation pair, so an item computes 2 * qkv rows; it must divide head_dim / 2. Each query
    head's attention is cut into attend_splits items over the cache's columns (the reference executor takes
    any number; the kernel one, see persistent_decode)."""
    qkv: int = 16
    o_proj: int = 16
    gate_up: int = 16
    down: int = 16
    lm_head: int = 384
    attend_splits: int = 1


@dataclass(frozen=True)
class WorkItem:
    index: int
    op: str
    layer: int          # -1 for the items after the last layer
    part: int           # the head (qkv: of the fused q/k/v heads), attend's head * attend_splits + split, or
                        # the tile index
    cols: tuple[int, int]  # the output rows it writes: qkv the first half's rows of the fused projection,
                           # attend its head, lm_head a vocabulary tile, else a tile of the output columns
    wait: int | None    # the counter it waits on, None for the first items of a step
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
    half = shape.head_dim // 2
    if min(tiles.qkv, tiles.o_proj, tiles.gate_up, tiles.down, tiles.lm_head, tiles.attend_splits) <= 0 or \
            half % tiles.qkv:
        raise ValueError(f"tiles must be positive and qkv ({tiles.qkv}) must divide head_dim / 2 ({half})")
    s = Schedule(shape, tiles)
    fused_heads = shape.heads + 2 * shape.kv_heads  # query heads, key heads, value heads
    o_tiles, gu_tiles = _tiles(shape.hidden, tiles.o_proj), _tiles(shape.intermediate, tiles.gate_up)
    down_tiles, lm_tiles = _tiles(shape.hidden, tiles.down), _tiles(shape.vocab, tiles.lm_head)
    qkv_items = fused_heads * (half // tiles.qkv)

    def add(op, layer, part, cols, wait, wait_count, signal):
        s.items.append(WorkItem(len(s.items), op, layer, part, cols, wait, wait_count, signal))

    prev_down, prev_count = None, 0
    for layer in range(shape.layers):
        projected_qkv, attended = s.counter(f"qkv[{layer}]"), s.counter(f"attend[{layer}]")
        projected, activated = s.counter(f"o_proj[{layer}]"), s.counter(f"gate_up[{layer}]")
        down = s.counter(f"down[{layer}]")
        for head in range(fused_heads):
            for lo in range(head * shape.head_dim, head * shape.head_dim + half, tiles.qkv):
                add("qkv", layer, head, (lo, lo + tiles.qkv), prev_down, prev_count, projected_qkv)
        for head in range(shape.heads):
            for split in range(tiles.attend_splits):
                add("attend", layer, head * tiles.attend_splits + split, (head, head + 1), projected_qkv, qkv_items,
                    attended)
        for j, cols in enumerate(o_tiles):
            add("o_proj", layer, j, cols, attended, shape.heads * tiles.attend_splits, projected)
        for j, cols in enumerate(gu_tiles):
            add("gate_up", layer, j, cols, projected, len(o_tiles), activated)
        for j, cols in enumerate(down_tiles):
            add("down", layer, j, cols, activated, len(gu_tiles), down)
        prev_down, prev_count = down, len(down_tiles)
    logits, done = s.counter("lm_head"), s.counter("argmax")
    for j, cols in enumerate(lm_tiles):
        add("lm_head", -1, j, cols, prev_down, prev_count, logits)
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
