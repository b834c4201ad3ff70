"""Graceful drain of an engine server (prefill, decode or colocated) on SIGTERM.

Once draining, the server refuses new work (``NEW_WORK_PATHS``: 503, an OpenAI error object and a
``Retry-After`` header, so a client or router retries elsewhere), its ``/health`` answers 503 with
``{"status": "draining", ...}`` (a router or load balancer stops sending), and everything already
in flight runs to its end: decode streams, and prefill requests, which answer only after their
room's KV left or failed. When nothing is left, or ``--graceful-shutdown-timeout`` passed, the
server stops; what is left then ends with a 503 error that names the timeout. Info, metrics and
``/abort_request`` stay served while draining.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from aiohttp import web

from pdserve.engine.frontend import openai_api as api

logger = logging.getLogger(__name__)

NEW_WORK_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/health_generate"})
RETRY_AFTER_S = 1  # another server can take the request at once; this one is going away
_POLL_S = 0.05  # how often the drain looks at the number of requests in flight
# after the last request finished: time for its handler to write the response's tail
_HANDLER_TAIL_S = 0.2


class Drain:
    def __init__(self, timeout: float, inflight: Callable[[], int]):
        """``timeout``: seconds in-flight requests get once draining starts (0: no drain, stop at once);
        ``inflight()``: the requests the server has in flight (the tokenizer manager's count)."""
        self.timeout = timeout
        self.inflight = inflight
        self.started: float | None = None  # time.monotonic() when the drain began

    @property
    def draining(self) -> bool:
        return self.started is not None

    def begin(self) -> bool:
        """Start draining; False when drains are off or one is already running (then stop at once)."""
        if self.timeout <= 0 or self.draining:
            return False
        self.started = time.monotonic()
        return True

    def remaining(self) -> float:
        return 0.0 if self.started is None else max(0.0, self.started + self.timeout - time.monotonic())

    def status(self) -> dict:
        return {"status": "draining", "inflight_requests": self.inflight(),
                "seconds_left": math.ceil(self.remaining())}

    async def run(self, fail_rest: Callable[[str], None]) -> int:
        """Wait until nothing is in flight or the timeout passed; then ``fail_rest`` what is left.
        Returns how many requests were still in flight at the end."""
        logger.info("draining: %d requests in flight, up to %gs", self.inflight(), self.timeout)
        while self.inflight() and self.remaining() > 0:
            await asyncio.sleep(_POLL_S)
        left = self.inflight()
        if left:
            reason = (f"server shut down: request still running when the graceful shutdown timeout "
                      f"({self.timeout:g}s) passed")
            logger.error("drain: %d requests still in flight after %gs; ending them with an error", left, self.timeout)
            fail_rest(reason)
        else:
            logger.info("drained: every request finished in %.1fs", time.monotonic() - self.started)
        await asyncio.sleep(_HANDLER_TAIL_S)
        return left


DRAIN_KEY = web.AppKey("drain", Drain)


@web.middleware
async def drain_middleware(request: web.Request, handler):
    """While draining: ``/health`` fails and new work is refused (inside the API-key middleware, so
    refusals are counted in /metrics)."""
    drain = request.app[DRAIN_KEY]
    if drain.draining and request.path == "/health":
        return web.json_response(drain.status(), status=503)
    if drain.draining and request.path in NEW_WORK_PATHS:
        body = api.error_object("server is draining (shutting down); retry on another server", code="unavailable")
        return web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return await handler(request)
