"""One request's life on the HTTP side: submit, turn token updates into text, stop, abort, count.

The scheduler thread delivers updates onto this request's asyncio queue. Text is detokenized incrementally
and passed through the stop-string matcher; a match cuts the text and aborts the request so its cache slot
is freed at the next step boundary. Leaving early for any reason (client gone, error) aborts it as well.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from eyas.server.detokenize import Detokenizer, StopMatcher
from eyas.server.errors import APIError
from eyas.server.protocol import usage
from eyas.server.scheduler import Failure, QueueFull, Submission, Unavailable


class Generation:
    def __init__(self, scheduler, tokenizer, metrics, prompt_ids: list[int], params, stops: list[str],
                 arrival: float, prefix: str):
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.scheduler = scheduler
        self.metrics = metrics
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = Detokenizer(tokenizer, prompt_ids)
        self.stop = StopMatcher(stops)
        self.arrival = arrival
        self.completion_tokens = 0
        self.verify_passes = 0
        self.finish_reason: str | None = None
        self._logprobs: list = []  # TokenLogprobs received since the last piece of text was handed out
        self._last: float | None = None
        self._engine_done = False  # the engine finished (or dropped) the request by itself: no abort needed
        self._queue: asyncio.Queue = asyncio.Queue()

    def start(self) -> None:
        """Submit to the scheduler; refusals become HTTP errors before any response starts."""
        loop = asyncio.get_running_loop()

        def deliver(event):  # runs on the scheduler thread
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the event loop is already closed: nobody is listening
                pass

        try:
            self.scheduler.submit(Submission(self.id, self.prompt_ids, self.params, deliver))
        except QueueFull as e:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(503, str(e), code="server_overloaded") from None
        except Unavailable as e:
            raise APIError(503, f"the server cannot take requests: {e}", code="unavailable") from None

    async def text(self):
        """Yields (text delta, finish_reason or None, the TokenLogprobs of the tokens that arrived since the
        previous item: [] unless the request asked for them); the last item carries the finish reason."""
        outcome = "aborted"
        try:
            while True:
                event = await self._queue.get()
                if isinstance(event, Failure):
                    outcome, self._engine_done = "failed", True
                    raise APIError(500, f"generation failed: {event.message}")
                if event.error is not None:
                    outcome, self._engine_done = "refused", True
                    raise APIError(400, event.error)
                self._account(event)
                if event.logprobs:
                    self._logprobs.extend(event.logprobs)
                self._engine_done = event.finish_reason is not None
                out = self.stop.feed(self.detok.add(event.new_ids))
                if self.stop.stopped:
                    self.finish_reason = "stop"
                elif event.finish_reason is not None:
                    out += self.stop.feed(self.detok.flush())
                    out += self.stop.flush()
                    self.finish_reason = "stop" if self.stop.stopped else event.finish_reason
                if self.finish_reason is not None:
                    outcome = "finished"
                    yield out, self.finish_reason, self._take_logprobs()
                    return
                if out:
                    yield out, None, self._take_logprobs()
        finally:
            if not self._engine_done:
                # A stop string, a client that left, an error: the engine must let go of the slot.
                self.scheduler.abort(self.id)
            self.metrics.finished(outcome, len(self.prompt_ids), self.completion_tokens, self.verify_passes,
                                  time.perf_counter() - self.arrival if outcome == "finished" else None)

    def _take_logprobs(self) -> list:
        taken, self._logprobs = self._logprobs, []
        return taken

    def _account(self, event) -> None:
        now = time.perf_counter()
        n = len(event.new_ids)
        if n:
            if self._last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - self._last) / n)
            self._last = now
        self.completion_tokens += n
        self.verify_passes = event.verify_passes

    def usage(self) -> dict:
        return usage(len(self.prompt_ids), self.completion_tokens, self.verify_passes)
