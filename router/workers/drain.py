"""Graceful shutdown of the router (SIGTERM) and the drain of one worker (``POST /workers/drain``).

``Shutdown`` keeps the client requests in flight. Once ``drain()`` began, a new
request is answered 503 with ``Retry-After`` (another replica behind the same
Service can take it), ``/readiness`` fails so the load balancer stops sending,
and the requests in flight, streams included, finish. Those still running after
``--graceful-shutdown-timeout`` are cancelled with a reason: the request handler
then ends each with a clear error (a 503 JSON answer, or an SSE error event and
``[DONE]`` on a stream that already began), and the router exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from pdserve.router.errors import RouterError, error_response
from pdserve.router.workers.worker_registry import Worker, WorkerRegistry

log = logging.getLogger("pdserve.router.workers.drain")

RETRY_AFTER_S = 1  # a draining router's clients retry at once: the Service sends them to a live replica
# after the drain: how long the handlers cut off get to write their error, and how long the
# prefill legs still answering after their stream ended get to finish
CUT_OFF_GRACE_S = 5.0
# request storage: the response once its head went out
RESPONSE_KEY = web.RequestKey("pdserve.router.response", web.StreamResponse)
WORKER_DRAIN_POLL_S = 0.02


def shutting_down() -> RouterError:
    return RouterError(503, "the router is shutting down; retry (another replica answers)",
                       "service_unavailable", retry_after=RETRY_AFTER_S)


class Shutdown:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self.draining = False
        self.expired = False  # the timeout passed: what is left is being cut off
        self._in_flight: set[asyncio.Task] = set()  # the handlers of the requests in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def enter(self) -> None:
        """Count the current request in (its handler's task); raises the 503 once draining."""
        if self.draining:
            raise shutting_down()
        self._in_flight.add(asyncio.current_task())
        self._idle.clear()

    def leave(self) -> None:
        self._in_flight.discard(asyncio.current_task())
        if not self._in_flight:
            self._idle.set()

    async def drain(self) -> bool:
        """Refuse new requests and wait for those in flight; True when all finished in time."""
        self.draining = True
        t0 = time.monotonic()
        log.info("draining: %d request(s) in flight, --graceful-shutdown-timeout %g s",
                 self.in_flight, self.timeout)
        idle, hurry = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait((idle, hurry), timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        hurry.cancel()
        if self._idle.is_set():
            log.info("drained in %.1f s", time.monotonic() - t0)
            return True
        self.expired = True
        log.error("%d request(s) still in flight after %.1f s (--graceful-shutdown-timeout %g s%s): "
                  "ending them with an error", self.in_flight, time.monotonic() - t0, self.timeout,
                  ", cut short by a second signal" if self._hurry.is_set() else "")
        for task in list(self._in_flight):
            task.cancel("graceful shutdown timeout")
        try:
            await asyncio.wait_for(self._idle.wait(), CUT_OFF_GRACE_S)
        except asyncio.TimeoutError:
            log.error("%d request handler(s) did not end after being cancelled", self.in_flight)
        return False

    def hurry(self) -> None:
        """End the drain's wait now (a second SIGTERM or SIGINT): what is in flight is cut off."""
        self._hurry.set()

    def cut_off_message(self) -> str:
        return (f"the router shut down before this request finished (--graceful-shutdown-timeout "
                f"{self.timeout:g} s)")

    async def cut_off(self, request: web.Request) -> web.StreamResponse:
        """The end of a request cancelled by the timeout: called from its handler (which swallowed
        the cancellation). A stream that began gets an SSE error event; otherwise a 503 JSON."""
        err = RouterError(503, self.cut_off_message(), "service_unavailable", retry_after=RETRY_AFTER_S)
        response = request.get(RESPONSE_KEY)
        if response is None:
            return error_response(err)
        try:  # (write_eof after the stream's own end is a no-op)
            await response.write_eof(b"data: " + err.body() + b"\n\ndata: [DONE]\n\n")
        except (ConnectionResetError, RuntimeError):
            pass  # the client is gone too
        return response


async def remember_response(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's ``on_response_prepare`` signal: keep the response whose head went out, so that a
    stream cut off at shutdown can be ended with an error event on the same response."""
    request[RESPONSE_KEY] = response


async def drain_worker(registry: WorkerRegistry, worker: Worker, wait_secs: float) -> dict:
    """Send no new requests to ``worker``; wait up to ``wait_secs`` for its in-flight ones to
    finish. The answer is the worker's listing entry (``draining``, ``drained``, ``in_flight``)."""
    registry.set_draining(worker, True)
    # a leg whose pair was chosen just before counts itself in on its first step: let it run
    await asyncio.sleep(0)
    deadline = time.monotonic() + wait_secs
    while worker.load and time.monotonic() < deadline:
        await asyncio.sleep(WORKER_DRAIN_POLL_S)
    return worker.to_json()
