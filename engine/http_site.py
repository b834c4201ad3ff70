"""The listener of every aiohttp server here: request heads within a deadline, open connections
under a cap.

aiohttp closes a connection whose request head has not arrived within the runner's
``keepalive_timeout``, counted from the connection's start and from each answer and not reset by
a partial head (aiohttp >= 3.14, the lower bound in pyproject.toml; the slowloris tests hold it
to that), so that setting is the header timeout (``serve_limited``): a client sending its
headers a byte a minute is dropped, and so is an idle keep-alive connection. aiohttp has no cap on
connections; ``LimitedSite`` puts a thin protocol in front of each accepted connection that counts
it, and once ``max_connections`` are open it answers a new one 503 (a JSON message naming
``--max-connections``) and closes it, while the open ones go on being served.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from pdserve.engine.http_limits import HttpLimits


def refusal(max_connections: int) -> bytes:
    """The whole HTTP answer to a connection over the cap."""
    body = json.dumps({"error": {
        "message": f"the server already holds --max-connections ({max_connections}) open connections; retry later",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGate:
    """The open connections of one listener, against its cap."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.open = 0
        self.refused = 0  # connections answered 503 for the cap
        self.refusal = refusal(max_connections)

    def admit(self) -> bool:
        if self.open >= self.max_connections:
            self.refused += 1
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


class CountedConnection(asyncio.Protocol):
    """One accepted connection: refused over the cap, else handed to aiohttp's handler, which gets
    every event the transport delivers."""

    def __init__(self, gate: ConnectionGate, handler_factory):
        self.gate = gate
        self.handler_factory = handler_factory
        self.handler: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.gate.admit():
            transport.write(self.gate.refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        self.handler = self.handler_factory()
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        handler, self.handler = self.handler, None
        if handler is not None:
            self.gate.release()
            handler.connection_lost(exc)


class LimitedSite(web.BaseSite):
    """A TCP listener of an ``AppRunner`` that admits at most ``max_connections`` open connections."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int, backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self.gate = ConnectionGate(max_connections)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        handler_factory = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: CountedConnection(self.gate, handler_factory), self._host, self._port, backlog=self._backlog)


async def serve_limited(app: web.Application, host: str, port: int, limits: HttpLimits, *, backlog: int = 128,
                        **runner_kwargs) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (0: a free port; ``runner.addresses`` has the bound one) under
    ``limits``: each request head within the header timeout (the runner's keep-alive timeout), at
    most ``max_connections`` open. ``runner_kwargs`` go to the ``AppRunner``."""
    runner = web.AppRunner(app, keepalive_timeout=limits.header_timeout, **runner_kwargs)
    await runner.setup()
    await LimitedSite(runner, host, port, max_connections=limits.max_connections, backlog=backlog).start()
    return runner
