"""Concurrency limit with a bounded waiting queue (``--max-concurrent-requests``, ``--queue-size``,
``--queue-timeout-secs``), ordered by priority then arrival.

Without ``--enable-priority-scheduling`` every request has priority 0 and the queue is FIFO.
With it, a freed slot goes to the waiting request whose priority comes first (the largest value,
or the smallest with ``--schedule-low-priority-values-first``, as SGLang orders them), arrival order
among equals. A full queue answers 429 to a newcomer, unless the newcomer's priority comes before
the last queued request's: then that one leaves the queue with the 429 instead, so a queue of
batch work never locks an interactive request out. A wait past the timeout is a 429 too.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter

from pdserve.router.errors import RouterError, too_many_requests


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_secs: float,
                 low_priority_values_first: bool = False):
        self.max_concurrent = max_concurrent  # -1: unlimited
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout_secs
        self.low_first = low_priority_values_first
        self.active = 0
        # (rank, arrival, priority, future): the smallest rank, then the earliest arrival, pops first;
        # entries whose future is done (timed out, cancelled, displaced) are skipped when popped
        self._heap: list[tuple[int, int, int, asyncio.Future]] = []
        self._arrival = itertools.count()
        self._waiting: Counter[int] = Counter()  # priority -> requests waiting now
        self.displaced = 0  # requests pushed out of a full queue by a higher priority

    @property
    def queued(self) -> int:
        return sum(self._waiting.values())

    def queued_by_priority(self) -> dict[int, int]:
        """Waiting requests per priority value (for /metrics)."""
        return {p: n for p, n in self._waiting.items() if n}

    def _rank(self, priority: int) -> int:
        return priority if self.low_first else -priority

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting in the queue if needed; raises a 429 RouterError."""
        if self.max_concurrent < 0 or self.active < self.max_concurrent:
            self.active += 1
            return
        if self.queued >= self.queue_size and not self._displace_for(priority):
            raise too_many_requests(f"too many requests: {self.active} in flight and the queue "
                                    f"({self.queue_size}) is full")
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self._rank(priority), next(self._arrival), priority, fut))
        self._waiting[priority] += 1
        try:
            async with asyncio.timeout(self.queue_timeout):  # wait_for (3.11) can swallow a cancel
                await fut
        except asyncio.TimeoutError:
            if _handed_over(fut):  # the slot came as the timeout fired: pass it on
                self.release()
            raise too_many_requests(f"request waited in the queue longer than "
                                    f"{self.queue_timeout}s") from None
        except asyncio.CancelledError:
            if _handed_over(fut):
                self.release()  # the slot was handed over as we were cancelled: pass it on
            raise
        finally:
            if not fut.done():
                fut.cancel()
            if fut.cancelled():  # left without a slot; release() and _displace_for count their own
                self._waiting[priority] -= 1
        # the releasing request handed its slot over: `active` is unchanged

    def release(self) -> None:
        while self._heap:
            _, _, priority, fut = heapq.heappop(self._heap)
            if not fut.done():
                self._waiting[priority] -= 1
                fut.set_result(None)
                return
        self.active -= 1

    def _displace_for(self, priority: int) -> bool:
        """Push the last waiting request out with a 429 when ``priority`` comes before it."""
        live = [e for e in self._heap if not e[3].done()]
        if not live:
            return False
        last = max(live, key=lambda e: (e[0], e[1]))
        if last[0] <= self._rank(priority):
            return False
        self._waiting[last[2]] -= 1
        self.displaced += 1
        last[3].set_exception(RouterError(
            429, f"request left the full queue for one of higher priority ({priority} over {last[2]})",
            "rate_limit_error"))
        return True


def _handed_over(fut: asyncio.Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
