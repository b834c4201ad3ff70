"""Concurrency limit with a bounded FIFO queue (``--max-concurrent-requests``, ``--queue-size``,
``--queue-timeout-secs``). A full queue or a wait past the timeout is a 429."""

from __future__ import annotations

import asyncio
from collections import deque

from pdserve.router.errors import too_many_requests


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_secs: float):
        self.max_concurrent = max_concurrent  # -1: unlimited
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout_secs
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if needed; raises a 429 RouterError."""
        if self.max_concurrent < 0 or self.active < self.max_concurrent:
            self.active += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise too_many_requests(f"too many requests: {self.active} in flight and the queue "
                                    f"({self.queue_size}) is full")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.queue_timeout):  # wait_for (3.11) can swallow a cancel
                await fut
        except asyncio.TimeoutError:
            raise too_many_requests(f"request waited in the queue longer than "
                                    f"{self.queue_timeout}s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            raise
        finally:
            if not fut.done() or fut.cancelled():
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
        # the releasing request handed its slot over: `active` is unchanged

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1
