"""The admission queue with tenants (``--tenant-config``, ``--tenant-header``, ``--slo-ttft-ms``):
the same global slots, queue bound and timeout as router/admission.py, shared fairly between
tenants.

Order: priority bands first, as router/admission.py orders a queue (the largest
``x-pdserve-priority`` first, or the smallest with ``--schedule-low-priority-values-first``), and
a request sent at lowest priority by ``--slo-miss-policy deprioritize`` after every band. Inside a
band, tenants share by deficit round-robin on tokens (prompt + max tokens; weights from the
tenant file, router/tenancy/drr.py), arrival order inside a tenant. A tenant at its
``max_concurrent`` waits even while global slots are free, and its queued requests are passed
over until one of its own finishes.

A full queue (``--queue-size``) makes room fairly: when another tenant holds more of the queue
than the newcomer's would by weight, that tenant's last request leaves with a 429; otherwise the
newcomer displaces its own tenant's last request only when its priority comes first (as without
tenants), else it gets the 429. So one tenant's flood fills the queue but never locks another out.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field

from pdserve.router.errors import RouterError, too_many_requests
from pdserve.router.tenancy.drr import DEFAULT_QUANTUM, DeficitRoundRobin
from pdserve.router.tenancy.tenant_config import DEFAULT_TENANT, TenantTable

LAST_BAND = 1  # the band flag of a request deprioritized by its SLO: after every priority


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int
    band: tuple[int, int]
    prompt_tokens: int
    seq: int
    fut: asyncio.Future = field(repr=False)
    left: bool = False  # counted out of the queue (dispatched, displaced, timed out or cancelled)


class FairAdmission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_secs: float,
                 low_priority_values_first: bool, table: TenantTable, quantum: int = DEFAULT_QUANTUM):
        self.max_concurrent = max_concurrent  # -1: unlimited
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout_secs
        self.low_first = low_priority_values_first
        self.table = table
        self.quantum = quantum
        self.active = 0
        self.active_by_tenant: Counter[str] = Counter()
        self._bands: dict[tuple[int, int], DeficitRoundRobin[_Waiter]] = {}
        self._waiters: dict[str, list[_Waiter]] = {}  # tenant -> its live waiters, in arrival order
        self._seq = itertools.count()
        self.displaced = 0

    # what /metrics and the TTFT estimate read ---------------------------------------------------
    @property
    def queued(self) -> int:
        return sum(len(ws) for ws in self._waiters.values())

    def queued_by_priority(self) -> dict[int, int]:
        out: Counter[int] = Counter()
        for ws in self._waiters.values():
            for w in ws:
                out[w.priority] += 1
        return dict(out)

    def prompt_tokens_ahead(self, tenant: str, priority: int, prompt_tokens: int) -> float:
        """Prompt tokens that would leave the queue before a newcomer (the TTFT estimate's queue):
        all of the bands before its own, and in its own band its tenant's and, from each other
        tenant, at most its fair share against them (deficit round-robin serves them in turns)."""
        band = self._band(priority, False)
        before = 0
        same: Counter[str] = Counter()
        for t, ws in self._waiters.items():
            for w in ws:
                if w.band < band:
                    before += w.prompt_tokens
                elif w.band == band:
                    same[t] += w.prompt_tokens
        mine = same.pop(tenant, 0)
        turns = (mine + prompt_tokens) / self.table.spec(tenant).weight
        return before + mine + sum(min(n, turns * self.table.spec(t).weight) for t, n in same.items())

    def queued_by_tenant_priority(self) -> dict[tuple[str, int], int]:
        out: Counter[tuple[str, int]] = Counter()
        for tenant, ws in self._waiters.items():
            for w in ws:
                out[(tenant, w.priority)] += 1
        return dict(out)

    # slots --------------------------------------------------------------------------------------
    def _band(self, priority: int, last: bool) -> tuple[int, int]:
        return (LAST_BAND if last else 0, priority if self.low_first else -priority)

    def _under_cap(self, tenant: str) -> bool:
        cap = self.table.spec(tenant).max_concurrent
        return cap is None or self.active_by_tenant[tenant] < cap

    def _global_free(self) -> bool:
        return self.max_concurrent < 0 or self.active < self.max_concurrent

    def _take(self, tenant: str) -> None:
        self.active += 1
        self.active_by_tenant[tenant] += 1

    async def acquire(self, priority: int = 0, tenant: str = DEFAULT_TENANT, cost: int = 1,
                      prompt_tokens: int = 0, last: bool = False) -> None:
        """Take a slot for ``tenant``, waiting in the queue if needed; raises a 429 RouterError.
        ``cost``: the request's tokens (its fair-share charge); ``last``: queue after every band."""
        if self._global_free() and self._under_cap(tenant):
            self._take(tenant)
            return
        band = self._band(priority, last)
        if self.queued >= self.queue_size and not self._make_room(tenant, band, priority):
            raise RouterError(429, f"too many requests: {self.active} in flight and the queue "
                              f"(--queue-size {self.queue_size}) is full", "rate_limit_error", "queue_size")
        fut = asyncio.get_running_loop().create_future()
        w = _Waiter(tenant, priority, band, prompt_tokens, next(self._seq), fut)
        drr = self._bands.get(band)
        if drr is None:
            drr = self._bands[band] = DeficitRoundRobin(self.quantum)
        drr.push(tenant, self.table.spec(tenant).weight, 0, cost, w)
        self._waiters.setdefault(tenant, []).append(w)
        try:
            async with asyncio.timeout(self.queue_timeout):
                await fut
        except asyncio.TimeoutError:
            if _handed_over(fut):  # the slot came as the timeout fired: pass it on
                self.release(tenant)
            raise RouterError(429, f"request waited in the queue longer than --queue-timeout-secs "
                              f"({self.queue_timeout}s)", "rate_limit_error", "queue_timeout_secs") from None
        except asyncio.CancelledError:
            if _handed_over(fut):
                self.release(tenant)  # the slot came as we were cancelled: pass it on
            raise
        finally:
            if not fut.done():
                fut.cancel()
            self._leave(w)

    def release(self, tenant: str = DEFAULT_TENANT) -> None:
        self.active -= 1
        self.active_by_tenant[tenant] -= 1
        if not self.active_by_tenant[tenant]:
            del self.active_by_tenant[tenant]
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the next waiters by band, then DRR among tenants under their cap."""
        while self._global_free():
            picked = None
            for band in sorted(self._bands):
                picked = self._bands[band].pop(self._under_cap, _alive)
                if picked is not None:
                    break
            self._bands = {b: d for b, d in self._bands.items() if any(True for _ in d.entries())}
            if picked is None:
                return
            _, w = picked
            self._take(w.tenant)
            self._leave(w)
            w.fut.set_result(None)

    def _leave(self, w: _Waiter) -> None:
        if w.left:
            return
        w.left = True
        ws = self._waiters[w.tenant]
        ws.remove(w)
        if not ws:
            del self._waiters[w.tenant]

    def _make_room(self, tenant: str, band: tuple[int, int], priority: int) -> bool:
        """Push one waiting request out with a 429 to queue a newcomer of ``tenant`` (see above)."""
        live = {t: [w for w in ws if _alive(w)] for t, ws in self._waiters.items()}
        live = {t: ws for t, ws in live.items() if ws}
        if not live:
            return False

        def share(t: str, extra: int = 0) -> float:
            return (len(live.get(t, ())) + extra) / self.table.spec(t).weight

        heaviest = max(live, key=share)
        if heaviest != tenant and share(heaviest) > share(tenant, 1):
            victim = max(live[heaviest], key=lambda w: (w.band, w.seq))
            reason = f"tenant {tenant!r}, whose share of the queue is smaller"
        else:
            if tenant not in live:
                return False
            victim = max(live[tenant], key=lambda w: (w.band, w.seq))
            if victim.band <= band:
                return False
            reason = f"a request of higher priority ({priority} over {victim.priority})"
        self._leave(victim)
        self.displaced += 1
        victim.fut.set_exception(RouterError(
            429, f"request left the full queue (--queue-size {self.queue_size}) for {reason}",
            "rate_limit_error", "queue_size"))
        return True


def _alive(w: _Waiter) -> bool:
    return not w.fut.done()


def _handed_over(fut: asyncio.Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
