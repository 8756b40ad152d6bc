"""bench_persistent's LaunchWatch: a section that runs past the deadline is named with the counters its step
had not finished, and the process is ended; a section that ends in time, or none armed, fires nothing."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_persistent  # noqa: E402


class FakeStep:
    counters = [3, 1]

    def short_counters(self, counts):
        return [f"c{i} {g} of 3" for i, g in enumerate(counts) if g < 3]


def watch(exits):
    return bench_persistent.LaunchWatch(0.2, read=lambda step: step.counters, exit=exits.append, poll_s=0.01)


def test_a_section_past_the_deadline_names_the_short_counters(capsys):
    exits = []
    w = watch(exits)
    with w.watching("the launch of 1 row", FakeStep()):
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    w.close()
    assert exits == [3]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("HANG: the launch of 1 row did not finish within 0 s")
    assert out[1] == "HANG: short counters: c1 1 of 3"


def test_sections_in_time_fire_nothing(capsys):
    exits = []
    w = watch(exits)
    for _ in range(5):
        with w.watching("a quick launch", FakeStep()):
            time.sleep(0.02)
    time.sleep(0.4)  # nothing is armed now: past the deadline, still nothing fires
    w.close()
    assert exits == [] and capsys.readouterr().out == ""
