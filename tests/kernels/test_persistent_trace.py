"""A traced persistent step's analysis, on stamps simulated from the schedule with known costs."""

import pytest
import torch

from eyas.kernels.persistent_schedule import DecoderShape, Tiles, build_schedule
from eyas.kernels.persistent_trace import critical_path, trace_summary

SHAPE = DecoderShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=3, vocab=96)
TILES = Tiles(qkv=4, o_proj=16, gate_up=32, down=16, lm_head=40)
GAP, POLL, NOTICE = 0.1, 0.2, 0.5  # us
WORK = {"qkv": 1.0, "attend": 2.0, "o_proj": 0.5, "gate_up": 1.5, "down": 1.25, "lm_head": 0.75, "argmax": 0.25}


def simulate(schedule, programs):
    """Stamps [items, 3] in ns as the kernel would leave them: item i on program i % programs after that
    program's previous item (plus GAP); its inputs arrive POLL after its start, or NOTICE after its last
    producer finished if that is later; then it works WORK[op]."""
    t = torch.zeros(len(schedule.items), 3, dtype=torch.float64)
    last_done: dict[int, float] = {}
    for item in schedule.items:
        i = item.index
        t[i, 0] = t[i - programs, 2] + GAP if i >= programs else 0.0
        ready = last_done[item.wait] + NOTICE if item.wait is not None else 0.0
        t[i, 1] = max(t[i, 0] + POLL, ready)
        t[i, 2] = t[i, 1] + WORK[item.op]
        last_done[item.signal] = max(last_done.get(item.signal, 0.0), float(t[i, 2]))
    return (t * 1e3 + 5e9).round().to(torch.int64)  # %globaltimer: ns since some epoch


def check_sums(path, stamps):
    total = path[-1]
    t = stamps.double() / 1e3
    assert total["op"] == "path"
    assert total["notice_us"] + total["poll_us"] + total["gap_us"] + total["work_us"] == \
        pytest.approx(total["length_us"], abs=1e-6)
    assert total["items"] == total["data"] + total["program"] == sum(r["items"] for r in path[:-1])
    assert total["length_us"] <= float(t[:, 2].max() - t[:, 0].min()) + 1e-6


def test_one_program_is_its_own_critical_path():
    schedule = build_schedule(SHAPE, TILES)
    stamps = simulate(schedule, 1)
    path = critical_path(schedule, stamps, 1)
    check_sums(path, stamps)
    total, n = path[-1], len(schedule.items)
    assert (total["items"], total["program"], total["data"]) == (n, n, 0)
    assert total["work_us"] == pytest.approx(sum(WORK[i.op] for i in schedule.items))
    assert total["gap_us"] == pytest.approx(GAP * (n - 1))
    t = stamps.double() / 1e3
    assert total["poll_us"] == pytest.approx(float((t[:, 1] - t[:, 0]).sum()))  # its own producer's notice too
    assert total["poll_us"] > POLL * n


def test_a_program_per_item_follows_the_data():
    schedule = build_schedule(SHAPE, TILES)
    n = len(schedule.items)
    stamps = simulate(schedule, n)
    path = critical_path(schedule, stamps, n)
    check_sums(path, stamps)
    total = path[-1]
    # every item starts at once, so each one on the path but the first waited for its producer
    assert total["program"] == 1 and total["data"] == total["items"] - 1
    assert total["notice_us"] == pytest.approx(NOTICE * total["data"])
    per_op = {r["op"]: r for r in path[:-1]}
    L = SHAPE.layers
    # a layer's five stages, then the LM head and the argmax
    assert {op: per_op[op]["items"] for op in per_op} == {"qkv": L, "attend": L, "o_proj": L, "gate_up": L,
                                                          "down": L, "lm_head": 1, "argmax": 1}
    assert total["length_us"] == pytest.approx(POLL + NOTICE * total["data"] + sum(WORK[op] * r["items"] for op, r
                                                                                     in per_op.items()))


def test_trace_summary_reads_the_same_stamps():
    schedule = build_schedule(SHAPE, TILES)
    n = len(schedule.items)
    summary = {r["op"]: r for r in trace_summary(schedule, simulate(schedule, n))}
    assert summary["gate_up"]["work_us"] == pytest.approx(WORK["gate_up"])
    assert summary["down"]["notice_us"] == pytest.approx(NOTICE)
    assert summary["step"]["items"] == n
