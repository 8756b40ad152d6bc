"""Where a traced persistent step's time went (eyas.kernels.persistent_decode with TRACE): per op, and along the
step's critical path.

A traced launch leaves three %globaltimer stamps per item (nanoseconds): start, inputs arrived (the last
input word of this step read), done. Item i runs on program i % W, after the program's previous item.
"""

from __future__ import annotations

import torch

from eyas.kernels.persistent_decode import OPS
from eyas.kernels.persistent_schedule import Schedule


def _microseconds(stamps: torch.Tensor) -> torch.Tensor:
    t = stamps.cpu().double()
    return (t - t[:, 0].min()) / 1e3


def _last_signals(schedule: Schedule, t: torch.Tensor) -> dict[int, int]:
    """Counter -> the item that signals it last (the producer its consumers wait for)."""
    last: dict[int, int] = {}
    for item in schedule.items:
        at = last.get(item.signal)
        if at is None or t[item.index, 2] > t[at, 2]:
            last[item.signal] = item.index
    return last


def trace_summary(schedule: Schedule, stamps: torch.Tensor) -> list[dict]:
    """Per op: how long its items waited for their inputs (from the item's start to the last input word of
    this step read), how long they then worked, and how late their inputs arrived after the last producer
    finished (the cost of a stage boundary). Times in microseconds; medians over the op's items (the
    latency: over items that waited)."""
    t = _microseconds(stamps)
    last = _last_signals(schedule, t)
    out = []
    for op in OPS:
        mine = [i for i in schedule.items if i.op == op]
        if not mine:
            continue
        idx = torch.tensor([i.index for i in mine])
        late = [float(t[i.index, 1] - t[last[i.wait], 2]) for i in mine
                if i.wait is not None and float(t[i.index, 1] - t[i.index, 0]) > 0.05]
        out.append(dict(op=op, items=len(mine), wait_us=float((t[idx, 1] - t[idx, 0]).median()),
                        work_us=float((t[idx, 2] - t[idx, 1]).median()),
                        notice_us=float(torch.tensor(late).median()) if late else 0.0,
                        last_done_us=float(t[idx, 2].max())))
    out.append(dict(op="step", items=len(schedule.items), wait_us=0.0, work_us=0.0, notice_us=0.0,
                    last_done_us=float(t[:, 2].max())))
    return out


def critical_path(schedule: Schedule, stamps: torch.Tensor, programs: int) -> list[dict]:
    """The chain of items that set the step's length, walked back from the item that finished last, summed
    per op (microseconds). An item that started before its last producer finished waited for data: its
    predecessor is that producer, and the time from the producer's end to the item's inputs arriving is
    `notice` (the stage boundary's cost). Otherwise its program was the bottleneck: its predecessor is the
    program's previous item, `gap` is the time between that item's end and this one's start, and `poll` the
    time from its start to its inputs (weight loads issued, inputs read once). `work` is from the inputs'
    arrival to the end. The components of all ops sum to the path's length, from its first item's start to
    the step's end; `data` and `program` count the items of each kind."""
    t = _microseconds(stamps)
    last = _last_signals(schedule, t)
    per_op = {op: dict(op=op, items=0, data=0, program=0, notice_us=0.0, poll_us=0.0, gap_us=0.0, work_us=0.0)
              for op in OPS}
    cur = int(t[:, 2].argmax())
    end = float(t[cur, 2])
    while cur is not None:
        item = schedule.items[cur]
        row = per_op[item.op]
        row["items"] += 1
        row["work_us"] += float(t[cur, 2] - t[cur, 1])
        producer = last.get(item.wait) if item.wait is not None else None
        if producer is not None and t[producer, 2] > t[cur, 0]:
            row["data"] += 1
            row["notice_us"] += float(t[cur, 1] - t[producer, 2])
            cur = producer
            continue
        row["program"] += 1
        row["poll_us"] += float(t[cur, 1] - t[cur, 0])
        prev = cur - programs if cur >= programs else None
        if prev is None:
            start = float(t[cur, 0])
        else:
            row["gap_us"] += float(t[cur, 0] - t[prev, 2])
        cur = prev
    rows = [r for r in per_op.values() if r["items"]]
    total = {k: sum(r[k] for r in rows) for k in ("items", "data", "program", "notice_us", "poll_us", "gap_us",
                                                  "work_us")}
    rows.append(dict(op="path", **total, length_us=end - start))
    return rows
