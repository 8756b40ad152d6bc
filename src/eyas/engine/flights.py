"""Results of GPU work enqueued ahead of the host, read back a step later (decode_ahead.py, spec_ahead.py), and
the loop both modes run to keep one step ahead (AheadOfHost).

Each result is copied into pinned host memory without waiting, and an event marks when the copy is done, so
the host reads it while the next step runs. At most two steps are in flight at once, so a ring of three
buffers per result shape never hands out one that is not yet read.
"""

from __future__ import annotations

import torch


class Flight:
    """One enqueued step's result, copied to host memory, ready once `event` has passed."""

    def __init__(self, result: torch.Tensor, host: torch.Tensor):
        self.host = host
        if result.is_cuda:
            self.host.copy_(result, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host.copy_(result)
            self.event = None

    def read(self, n: int) -> list:
        """The first n rows, as lists (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[:n].tolist()


class Flights:
    """The steps in flight, oldest first."""

    RING = 3

    def __init__(self):
        self._queue: list[Flight] = []
        self._buffers: dict[tuple, list[torch.Tensor]] = {}  # per (shape, dtype): a ring of host buffers
        self.sent = 0  # results sent so far

    def send(self, result: torch.Tensor) -> None:
        """Start copying `result` (a device tensor the next step may overwrite) to the host."""
        key = (tuple(result.shape), result.dtype)
        ring = self._buffers.get(key)
        if ring is None:
            ring = self._buffers[key] = [torch.empty(result.shape, dtype=result.dtype, pin_memory=result.is_cuda)
                                         for _ in range(self.RING)]
        self.sent += 1
        self._queue.append(Flight(result, ring[self.sent % self.RING]))

    def pop(self) -> Flight:
        """The oldest step in flight, no longer counted as in flight."""
        return self._queue.pop(0)

    def __len__(self) -> int:
        return len(self._queue)


class AheadOfHost:
    """What decoding and speculating ahead of the host share: the batch held while steps are in flight, and
    the loop that keeps one step ahead. A subclass provides _start(seqs) (take the batch, enqueue its first
    step), _may_enqueue(), _enqueue(), _consume() (read the oldest step into the sequences) and drain()."""

    def __init__(self):
        self.seqs: list | None = None  # the batch while this mode runs, in row order
        self.flights = Flights()

    @property
    def active(self) -> bool:
        return self.seqs is not None

    def holds(self, seqs) -> bool:
        """Whether `seqs` is the batch this mode holds, the same sequences in the same rows."""
        return len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs))

    def advance(self, seqs):
        """Enqueue the next step (unless it may not run: a sequence about to reach max_tokens, a bound), then
        read the oldest step in flight into the sequences; drain when one stopped."""
        if not self.active:
            self._start(seqs)
        if self._may_enqueue():
            self._enqueue()
        self._consume()
        if any(s.finished for s in self.seqs) or not self.flights:
            self.drain()
