"""The client of the two legs: pooled keep-alive connections to the workers, over aiohttp.

One ``aiohttp.ClientSession`` per pool, set up for plain JSON posts (no
cookies, no decompression, no automatic headers). Failures are one typed
``UpstreamError``. A request that is cancelled, or an answer closed before its
end, closes its connection, which is how a server learns that its client went
away (and aborts the room).

A variant of the hand-written HTTP/1.1 client (httptools) it replaces, built
to measure the difference with ``scripts/bench_router.py --baseline-tree``.
"""

from __future__ import annotations

import asyncio

import aiohttp
from yarl import URL

_JSON = {"Content-Type": "application/json"}


class UpstreamError(Exception):
    """Connection refused or lost, timeout, or a malformed answer."""


class UpstreamResponse:
    """The answer of one leg; ``close()`` it (idempotent) when done with it."""

    __slots__ = ("_resp", "_timeout", "status", "content_type")

    def __init__(self, resp: aiohttp.ClientResponse, timeout: float):
        self._resp = resp
        self._timeout = timeout
        self.status = resp.status
        self.content_type = resp.content_type

    async def readany(self) -> bytes:
        """The body bytes received since the last call (waits for some); b"" at the end."""
        try:
            return await self._resp.content.readany()
        except Exception as e:  # noqa: BLE001 - every failure of a leg is one typed error
            raise _error(e, self._timeout, answered=True) from None

    def at_eof(self) -> bool:
        """True when the whole body has arrived and been handed over by ``readany``."""
        return self._resp.content.at_eof()

    async def read(self) -> bytes:
        """The whole body."""
        try:
            return await self._resp.read()
        except Exception as e:  # noqa: BLE001
            raise _error(e, self._timeout, answered=True) from None
        finally:
            self.close()

    def close(self) -> None:
        """Give the connection back when the answer is complete, else close it."""
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class UpstreamPool:
    def __init__(self, timeout: float, connect_timeout: float = 10.0, extra_headers: dict | None = None):
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._headers = dict(extra_headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}

    async def post(self, base_url: str, path: str, body: bytes) -> UpstreamResponse:
        """POST ``body`` (JSON) to ``base_url + path``; returns once the answer's head is in."""
        url = self._url(base_url, path)
        session = self._session or self._open()
        for attempt in (0, 1):
            try:
                resp = await session.post(url, data=body, headers=_JSON)
                return UpstreamResponse(resp, self.timeout)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # a kept-alive connection the server had just closed (aiohttp retries only
                # idempotent methods itself): try once on a new one
                if attempt == 0 and not isinstance(e, aiohttp.ClientConnectorError):
                    continue
                raise _error(e, self.timeout, answered=False) from None
            except Exception as e:  # noqa: BLE001
                raise _error(e, self.timeout, answered=False) from None
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self._headers, auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout))
        return self._session

    def _url(self, base_url: str, path: str) -> URL:
        url = self._urls.get((base_url, path))
        if url is None:
            url = URL(base_url.rstrip("/") + path)
            if url.scheme not in ("http", "https"):
                raise UpstreamError(f"worker URLs are http:// or https://, got {base_url}")
            self._urls[(base_url, path)] = url
        return url


def _error(e: Exception, timeout: float, answered: bool) -> UpstreamError:
    """aiohttp's exceptions as one ``UpstreamError`` whose message says what happened."""
    if isinstance(e, UpstreamError):
        return e
    if isinstance(e, asyncio.TimeoutError):
        return UpstreamError(f"no complete answer within {timeout}s")
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamError(f"cannot connect to {e.host}:{e.port}: {type(e).__name__}: {e}")
    if isinstance(e, aiohttp.ClientResponseError):  # the answer's head did not parse
        return UpstreamError(f"malformed HTTP answer: {e.message}")
    where = "mid-answer" if answered else "before the answer"
    return UpstreamError(f"connection lost {where}: {type(e).__name__}: {e}")
