"""Stop training between two steps on SIGTERM or SIGINT, with a checkpoint of the step reached.

A scheduler's time limit (or `timeout`) sends SIGTERM, Ctrl-C sends SIGINT. Killed in the middle of a step, a
run loses everything since its last periodic checkpoint; instead the trainer finishes the step it is in,
saves, and stops with TrainingStopped, and the same command resumes from exactly there. Only the first
signal is caught: a second one gets the default action, so a run that hangs can still be killed.
"""

from __future__ import annotations

import signal
import threading

from eyas.errors import EyasError

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(EyasError):
    """Training stopped on a signal after saving a checkpoint (a non-zero exit: the run is not finished)."""


class StopRequests:
    """A context in which SIGTERM / SIGINT only set `signal_name`; the previous handlers come back on exit."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # the next one is not caught
