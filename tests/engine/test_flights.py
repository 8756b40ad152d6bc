"""Results read a step late (eyas.engine.ahead.Flights): oldest first, each from its own host buffer, so a result
sent while an older one is unread never overwrites it."""

import torch

from eyas.engine.ahead import Flights


def test_results_come_back_oldest_first_and_intact():
    flights = Flights()
    device_buffer = torch.zeros(4, dtype=torch.long)  # a graph's output, overwritten by every step
    got = []
    for step in range(7):
        device_buffer.copy_(torch.arange(4) + 10 * step)
        flights.send(device_buffer)
        if len(flights) == 2:  # two in flight, as decoding ahead keeps them
            got.append(flights.pop().read(3))
    while len(flights):
        got.append(flights.pop().read(3))
    assert got == [[10 * step, 10 * step + 1, 10 * step + 2] for step in range(7)]
    assert flights.sent == 7 and not flights
