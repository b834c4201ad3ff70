"""A lean HTTP/1.1 client for the two legs: pooled keep-alive connections, one write per request.

The legs are the router's hot path, and a general client (aiohttp's) spends
more time building a request than the stand-in servers spend answering it
(against aiohttp's client for the legs, this one serves more requests per second
at less added latency and half the router's CPU time per request:
docs/PERFORMANCE.md, "Design choices"). This one only POSTs JSON to a known
``http(s)://host:port``: it writes the head and body in one ``transport.write``,
parses the answer with httptools (llhttp), and hands the body over as it
arrives. Failures are one typed ``UpstreamError``. A request that is cancelled
aborts its connection, which is how a server learns that its client went away
(and aborts the room).
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # pause reading a stream the client does not keep up with
TOO_LARGE = "too_large"  # UpstreamError cause: an answer over max_response_bytes


class UpstreamError(Exception):
    """Connection refused or lost, timeout, or a malformed answer; ``cause`` names which, for the
    router's retries-by-cause metric: connect, timeout, connection_lost, malformed, bad_url,
    too_large (not retried: any pair would answer as much)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "key", "transport", "parser", "status", "content_type", "chunks", "size",
                 "waiter", "headers_done", "complete", "keep_alive", "error", "paused", "_eof_body",
                 "_timer", "used")

    def __init__(self, pool: "UpstreamPool", key: tuple[str, int, bool]):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.used = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = ""
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.waiter: asyncio.Future | None = None
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.paused = False
        self._eof_body = True  # no Content-Length and not chunked: the body ends at EOF
        self._timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small requests and SSE events must not wait for Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed HTTP answer: {e}", "malformed"))
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self.pool._forget(self)
        if self.headers_done and not self.complete and self._eof_body and exc is None:
            self.on_message_complete()
        elif not self.complete:
            self._fail(UpstreamError(f"connection lost{': ' + str(exc) if exc else ''}"
                                     f"{' mid-answer' if self.headers_done else ' before the answer'}",
                                     "connection_lost"))

    # httptools callbacks ------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().decode("latin-1")
        elif n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self._eof_body = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.size += len(body)
        if self.size > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        # llhttp only knows this while the message is current
        self.keep_alive = self.parser.should_keep_alive()
        if self._timer is not None:
            self._timer.cancel()
        self._wake()

    # internals ---------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(error)

    def _timeout(self) -> None:
        self._fail(UpstreamError(f"no complete answer within {self.pool.timeout}s", "timeout"))
        self.transport.abort()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class UpstreamResponse:
    """The answer of one leg; ``close()`` it (idempotent) when done with it."""

    __slots__ = ("_conn", "status", "content_type", "_closed")

    def __init__(self, conn: _Connection):
        self._conn = conn
        self.status = conn.status
        self.content_type = conn.content_type
        self._closed = False

    async def readany(self) -> bytes:
        """The body bytes received since the last call (waits for some); b"" at the end."""
        c = self._conn
        while not c.chunks:
            if c.complete:
                return b""
            await c._wait()
        data = b"".join(c.chunks) if len(c.chunks) > 1 else c.chunks[0]
        c.chunks.clear()
        c.size = 0
        if c.paused:
            c.paused = False
            c.transport.resume_reading()
        return data

    def at_eof(self) -> bool:
        """True when the whole body has arrived and been handed over by ``readany``."""
        return self._conn.complete and not self._conn.chunks

    async def read(self) -> bytes:
        """The whole body, taken as it arrives (reading resumes past the high-water mark); one
        larger than the pool's ``max_response_bytes`` aborts the connection and raises an
        ``UpstreamError`` with cause ``too_large``."""
        c = self._conn
        cap = c.pool.max_response_bytes
        parts: list[bytes] = []
        total = 0
        while True:
            if c.chunks:
                total += c.size
                if total > cap:
                    self.close()
                    raise UpstreamError(f"the answer is larger than --max-response-bytes ({cap} bytes)",
                                        TOO_LARGE)
                parts.extend(c.chunks)
                c.chunks.clear()
                c.size = 0
                if c.paused:
                    c.paused = False
                    c.transport.resume_reading()
            if c.complete:
                break
            await c._wait()
        self.close()
        return b"".join(parts)

    def close(self) -> None:
        """Give the connection back when the answer is complete, else abort it."""
        if self._closed:
            return
        self._closed = True
        self._conn.pool._done(self._conn)


class UpstreamPool:
    def __init__(self, timeout: float, connect_timeout: float = 10.0, extra_headers: dict | None = None,
                 max_response_bytes: int | None = None):
        """``max_response_bytes``: the largest body ``read()`` takes whole (None: no cap; the router
        passes ``--max-response-bytes``); streams are relayed piece by piece and not capped."""
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes if max_response_bytes is not None else float("inf")
        self.connect_timeout = connect_timeout
        self._extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (extra_headers or {}).items())
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._heads: dict[tuple[str, str], tuple[tuple[str, int, bool], bytes]] = {}
        self._ssl = None

    async def post(self, base_url: str, path: str, body: bytes, headers: bytes = b"") -> UpstreamResponse:
        """POST ``body`` (JSON) to ``base_url + path``; returns once the answer's head is in.
        ``headers``: more header lines of this request alone (``name: value\\r\\n`` each)."""
        key, head = self._head(base_url, path)
        request = head + headers + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        for attempt in (0, 1):
            conn = await self._acquire(key)
            reused = conn.used
            conn.used = True
            conn._timer = asyncio.get_running_loop().call_later(self.timeout, conn._timeout)
            try:
                conn.transport.write(request)
                while not conn.headers_done:
                    await conn._wait()
                return UpstreamResponse(conn)
            except UpstreamError:
                self._done(conn)
                # a kept-alive connection the server had just closed: try once on a new one
                if reused and not conn.headers_done and attempt == 0 and conn.transport.is_closing():
                    continue
                raise
            except BaseException:  # cancelled: abort, so the server sees its client leave
                self._done(conn)
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.transport.close()
        for c in list(self._busy):
            c.transport.abort()
        self._idle.clear()

    def _head(self, base_url: str, path: str):
        cached = self._heads.get((base_url, path))
        if cached is None:
            u = urlsplit(base_url)
            if u.scheme not in ("http", "https"):
                raise UpstreamError(f"worker URLs are http:// or https://, got {base_url}", "bad_url")
            https = u.scheme == "https"
            key = (u.hostname, u.port or (443 if https else 80), https)
            head = (f"POST {u.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {u.netloc}\r\n"
                    f"Content-Type: application/json\r\n").encode("latin-1") + self._extra
            cached = self._heads[(base_url, path)] = (key, head)
        return cached

    async def _acquire(self, key: tuple[str, int, bool]) -> _Connection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.transport.is_closing():
                self._busy.add(conn)
                return conn
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the connection when a
            # cancel meets its completion, swallowing the cancel; a cancelled leg then went on and
            # held a prefill room nobody waited for (tests/router/test_upstream.py)
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1],
                                                       ssl=self._ssl_context() if key[2] else None)
        except (OSError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {type(e).__name__}: {e}", "connect") from None
        self._busy.add(conn)
        return conn

    def _ssl_context(self):
        if self._ssl is None:
            import ssl

            self._ssl = ssl.create_default_context()
        return self._ssl

    def _done(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if conn._timer is not None:
            conn._timer.cancel()
        if conn.complete and conn.error is None and conn.keep_alive \
                and not conn.transport.is_closing():
            conn._reset()
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.transport.abort()

    def _forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)


async def drain_response(resp) -> None:
    """Read an upstream stream to its end, then release it (reused when fully read)."""
    try:
        while await resp.readany():
            pass
    except Exception:  # noqa: BLE001 - the client already has its whole answer
        pass
    finally:
        resp.close()
