"""The bootstrap server inside each prefill server: where decode ranks find prefill ranks.

``PUT /route`` (a prefill rank registers), ``GET /route`` (whole topology, or one
rank with ``?dp_rank=&tp_rank=``; 503 until every expected rank registered),
``GET /health``. Bad or conflicting registrations get 400 with a JSON message, and so do
an unknown path (404) and a wrong method (405). With an
``auth`` (the shared secret's ``FrameAuth`` for ``bootstrap``), a ``PUT`` without a valid
``X-PDServe-KV-Auth`` header gets 401, is logged and counted (``refused``, ``on_refused``)
and registers nothing.
Its listener has the server's limits (``engine/http_site.py``): a request head within the header
timeout, a ``PUT`` body within ``read_timeout`` (else 408), at most ``max_connections`` open.
Run it with ``await server.start()`` inside a process's event loop, or with
``server.start_in_thread()`` in a process that has none.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import msgspec
from aiohttp import web

from pdserve.engine.http_json_errors import json_error_middleware
from pdserve.engine.http_limits import HTTP_READ_TIMEOUT, HttpLimits
from pdserve.engine.http_site import serve_limited
from pdserve.engine.kv_auth import AUTH_HEADER, AuthError, FrameAuth
from pdserve.engine.kv_transfer_config import DEFAULT_BOOTSTRAP_PORT
from pdserve.kvtransfer.messages import KV_KINDS, LATENT, RankRegistration, Topology

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": message}), content_type="application/json")


_json_errors = json_error_middleware(_error)  # aiohttp's own answers in this server's JSON shape


class BootstrapServer:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_BOOTSTRAP_PORT,
        dp_size: int = 1,
        tp_size: int = 1,
        *,
        auth: FrameAuth | None = None,
        on_refused: Callable[[], None] | None = None,
        limits: HttpLimits = HttpLimits(),
        read_timeout: float = HTTP_READ_TIMEOUT,
    ):
        if dp_size < 1 or tp_size < 1:
            raise ValueError(f"dp_size and tp_size must be >= 1, got {dp_size}, {tp_size}")
        self.host = host
        self.port = port  # 0 picks a free port; the bound one replaces it after start
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.auth = auth
        self.refused = 0  # PUT /route refused by authentication
        self._on_refused = on_refused  # e.g. the server's /metrics counter
        self.limits = limits
        self.read_timeout = read_timeout  # seconds a PUT's body may take to arrive
        self._ranks: dict[tuple[int, int], RankRegistration] = {}
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors])
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "registered": len(self._ranks), "expected": self._expected})

    @property
    def _expected(self) -> int:
        return self.dp_size * self.tp_size

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(self.read_timeout):
                body = await request.read()
        except TimeoutError:
            return _error(408, f"the request body did not arrive within {self.read_timeout:g} s")
        if self.auth is not None:
            try:
                self.auth.verify_http(request.headers.get(AUTH_HEADER), request.method, request.path, body)
            except AuthError as e:
                self.refused += 1
                if self._on_refused is not None:
                    self._on_refused()
                logger.warning("bootstrap: refused PUT /route from %s: %s", request.remote, e)
                return _error(401, f"authentication failed: {e}")
        try:
            reg = msgspec.json.decode(body, type=RankRegistration)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return _error(400, f"malformed registration: {e}")
        problem = self._validate(reg)
        if problem:
            logger.warning("bootstrap: rejected registration %s: %s", reg, problem)
            return _error(400, problem)
        self._ranks[(reg.dp_rank, reg.tp_rank)] = reg
        logger.info("bootstrap: dp %d tp %d at %s", reg.dp_rank, reg.tp_rank, reg.endpoint)
        return web.json_response({"status": "ok"})

    def _validate(self, reg: RankRegistration) -> str | None:
        if not 0 <= reg.dp_rank < self.dp_size:
            return f"dp_rank {reg.dp_rank} out of range [0, {self.dp_size})"
        if not 0 <= reg.tp_rank < self.tp_size:
            return f"tp_rank {reg.tp_rank} out of range [0, {self.tp_size})"
        if reg.tp_size != self.tp_size:
            return f"rank says tp_size {reg.tp_size} but this prefill server has tp_size {self.tp_size}"
        host, _, port = reg.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"endpoint must be host:port, got {reg.endpoint!r}"
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(reg, name) < 1:
                return f"{name} must be >= 1, got {getattr(reg, name)}"
        if not reg.kv_dtype:
            return "kv_dtype must be non-empty"
        if reg.kv_kind not in KV_KINDS:
            return f"kv_kind must be one of {', '.join(KV_KINDS)}, got {reg.kv_kind!r}"
        if reg.kv_kind == LATENT and reg.num_kv_heads != 1:
            return f"a latent KV pool holds one vector per token (num_kv_heads 1), got num_kv_heads {reg.num_kv_heads}"
        old = self._ranks.get((reg.dp_rank, reg.tp_rank))
        if old is not None and old != reg:
            return f"dp {reg.dp_rank} tp {reg.tp_rank} already registered as {old.endpoint} with different data"
        for other in self._ranks.values():
            if (other.dp_rank, other.tp_rank) == (reg.dp_rank, reg.tp_rank):
                continue
            if other.endpoint == reg.endpoint:
                return f"endpoint {reg.endpoint} already registered by dp {other.dp_rank} tp {other.tp_rank}"
            diff = other.layout().mismatch(reg.layout())
            if diff or other.backend != reg.backend:
                return f"conflicts with dp {other.dp_rank} tp {other.tp_rank}: {diff or 'backend differs'}"
        return None

    async def _get_route(self, request: web.Request) -> web.Response:
        if len(self._ranks) < self._expected:
            return _error(503, f"{len(self._ranks)} of {self._expected} prefill ranks registered; missing: "
                               f"{self.missing()}")
        q = request.query
        if "dp_rank" not in q and "tp_rank" not in q:
            topo = Topology(self.dp_size, self.tp_size, sorted(self._ranks.values(), key=lambda r: (r.dp_rank, r.tp_rank)))
            return web.Response(body=_json.encode(topo), content_type="application/json")
        try:
            key = (int(q.get("dp_rank", "0")), int(q.get("tp_rank", "0")))
        except ValueError:
            return _error(400, "dp_rank and tp_rank must be integers")
        reg = self._ranks.get(key)
        if reg is None:
            return _error(404, f"no prefill rank dp {key[0]} tp {key[1]}")
        return web.Response(body=_json.encode(reg), content_type="application/json")

    def missing(self) -> str:
        """The ranks not registered yet, e.g. ``dp 0 tp 1, dp 1 tp 1``."""
        return ", ".join(f"dp {d} tp {t}" for d in range(self.dp_size) for t in range(self.tp_size)
                         if (d, t) not in self._ranks)

    # -------------------------------------------------------------- running
    async def start(self) -> None:
        """Serve on the running event loop."""
        self._runner = await serve_limited(self.app(), self.host, self.port, self.limits, access_log=None)
        self.port = self._runner.addresses[0][1]  # the bound port (port 0 picks one)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self) -> "BootstrapServer":
        """Serve from a daemon thread with its own event loop; returns once listening."""
        started = threading.Event()
        errors: list[BaseException] = []

        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.start())
            except BaseException as e:  # noqa: BLE001 - reported to the starter
                errors.append(e)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.stop())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="bootstrap-server", daemon=True)
        self._thread.start()
        started.wait()
        if errors:
            raise errors[0]
        return self

    def stop_thread(self) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._thread = None
