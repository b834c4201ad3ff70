"""The router's HTTP plumbing: a client's request body read within ``--max-payload-size`` and
``--http-read-timeout``, and JSON answers.

A body whose declared length is over the limit is refused before any of it is read; one that
arrives without a length (chunked) is read up to the limit and refused there. Either way the
answer is a 413 naming the limit, and the router never holds more than the limit per request. A
body that has not all arrived within the read timeout is a 408 naming the flag.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from pdserve.router.errors import RouterError, payload_too_large


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The whole body; a 413 RouterError when it is larger than ``limit`` bytes, a 408 when it has
    not arrived within ``timeout`` seconds."""
    if request.content_length is not None and request.content_length > limit:
        raise payload_too_large(limit)
    try:
        if request.content.is_eof():  # all of it came with the head (most requests): nothing to time
            return await request.read()  # the application's client_max_size is the same limit
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise payload_too_large(limit) from None
    except TimeoutError:
        raise RouterError(408, f"the request body did not arrive within --http-read-timeout ({timeout:g} s)",
                          "request_timeout") from None


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


async def read_capped(resp, cap: int) -> bytes:
    """An aiohttp client answer's body, at most ``cap`` bytes (over it: a 502 naming the cap)."""
    parts, total = [], 0
    async for chunk in resp.content.iter_any():
        total += len(chunk)
        if total > cap:
            raise RouterError(502, f"the worker's answer is larger than --max-response-bytes ({cap} bytes)",
                              "upstream_error")
        parts.append(chunk)
    return b"".join(parts)
