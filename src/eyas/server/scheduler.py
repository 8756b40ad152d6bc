"""The front end's scheduler: one thread that batches requests into the workers' lockstep and hands tokens back.

Between two steps it forwards every new request and every abort to all workers and sends Steps. The workers
hold `steps_in_flight` Steps at once (eyas serve --steps-in-flight, default 2): when rank 0's result arrives,
the thread tops the queue up (new requests and aborts first) and only then hands the result's tokens out, so the workers never wait on it.
Requests join and leave a running batch at step boundaries (continuous batching), and the Engine admits
waiting requests while cache slots are free. An abort that a result's tokens prompt (a stop string) reaches
the workers after the steps already queued: those steps' tokens for it are dropped. The thread is the only
user of the WorkerGroup, so commands reach the workers in one order. Admission control is a count: at most
max_running requests in slots plus max_queue waiting; beyond that `submit` refuses at once (HTTP 503).

A worker that dies or fails ends the server: every live request gets a Failure, `healthy` turns False, and
`on_fatal` asks the HTTP server to exit (non-zero). It never hangs waiting on a dead rank: every wait polls
the worker processes.
"""

from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

from eyas.dist.launch import POLL_S, WorkerDied, WorkerGroup
from eyas.dist.messages import Abort, AddRequest, Step
from eyas.layers.sampling import SamplingParams


@dataclass
class Submission:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[object], None]  # called on the scheduler thread with a RequestUpdate or a Failure


@dataclass(frozen=True)
class Failure:
    message: str


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


class Scheduler:
    def __init__(self, group: WorkerGroup, max_running: int, max_queue: int, metrics, on_fatal=None,
                 steps_in_flight: int = 2):
        self.group = group
        self.capacity = max_running + max_queue
        self.metrics = metrics
        self.on_fatal = on_fatal or (lambda message: None)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, Submission] = {}   # owned by the scheduler thread
        self._count = 0                          # requests in the system, guarded by _lock
        self._lock = threading.Lock()
        self._stopping = False
        self.healthy = True
        self.error: str | None = None
        self._in_flight = 0                      # Steps sent whose results have not been received
        # With 2 the workers go on with the next step while this thread waits for a result, for the GIL, or hands
        # tokens out; with 1, the adaptive server was once slower than plain under load. Requests join, and aborts
        # land, one step later per extra step.
        self.steps_in_flight = steps_in_flight
        self.thread = threading.Thread(target=self._run, name="eyas-scheduler", daemon=True)

    # -- called from the HTTP side ----------------------------------------------------------------
    def submit(self, sub: Submission) -> None:
        with self._lock:
            if not self.healthy or self._stopping:
                raise Unavailable(self.error or "the server is shutting down")
            if self._count >= self.capacity:
                raise QueueFull(f"the server is at capacity ({self.capacity} requests running or queued); retry later")
            self._count += 1
        self.inbox.put(("add", sub))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    @property
    def in_system(self) -> int:
        return self._count

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what is live, then let the thread end (the HTTP server has already drained its requests)."""
        self._stopping = True
        self.inbox.put(("wake", None))
        self.thread.join(timeout)

    # -- the scheduler thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._cycle():
                pass
        except WorkerDied as e:
            self._fail(str(e))
        except Exception as e:  # a bug here must end the server loudly, never leave clients waiting
            traceback.print_exc()
            self._fail(f"scheduler error: {type(e).__name__}: {e}")

    def _cycle(self) -> bool:
        if not self._in_flight:
            self._forward(self._take(block=not self.live))
            if not self.live:
                return not self._stopping
            self._step()
        result = self.group.receive()
        self._in_flight -= 1
        # The next steps are queued before this one's tokens are handed out, so the workers compute while
        # this thread does its bookkeeping (and may wait for the GIL while the HTTP side detokenizes).
        ended = {u.id for u in result.updates if u.finish_reason is not None or u.error is not None}
        self._forward(self._take(block=False))
        while self._in_flight < self.steps_in_flight and any(rid not in ended for rid in self.live):
            self._step()
        self.metrics.step(result)
        for update in result.updates:
            sub = self.live.get(update.id)
            if sub is None:  # aborted while the step ran
                continue
            sub.deliver(update)
            if update.id in ended:
                self._leave(update.id)
        return True

    def _forward(self, items: list) -> None:
        """New requests and aborts go to every worker, in one order, between two steps."""
        for kind, item in items:
            if kind == "add":
                self.live[item.id] = item
                self.group.broadcast(AddRequest(item.id, item.prompt_ids, item.params))
            elif kind == "abort" and item in self.live:
                self.group.broadcast(Abort(item))
                self._leave(item)

    def _step(self) -> None:
        self.group.broadcast(Step())
        self._in_flight += 1

    def _take(self, block: bool) -> list:
        items = []
        if block:
            while True:
                try:
                    items.append(self.inbox.get(timeout=POLL_S))
                    break
                except queue.Empty:
                    dead = self.group.dead()
                    if dead is not None:
                        raise WorkerDied(f"worker {dead} exited with code {self.group.procs[dead].exitcode}")
                    if self._stopping:
                        return items
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def _leave(self, rid: str) -> None:
        self.live.pop(rid, None)
        with self._lock:
            self._count -= 1

    def _fail(self, message: str) -> None:
        with self._lock:
            self.healthy = False
            self.error = message
        waiting = [item for kind, item in self._take(block=False) if kind == "add"]
        for sub in list(self.live.values()) + waiting:
            sub.deliver(Failure(message))
        self.live.clear()
        self.on_fatal(message)
