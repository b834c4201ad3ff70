"""One aiohttp middleware for every HTTP server of pdserve: aiohttp's own error answers (no such
path, wrong method, body too large) come back as that server's JSON error object instead of
aiohttp's plain text, so a client parses every 4xx/5xx the same way."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


def json_error_middleware(render: Callable[[int, str], web.Response]):
    """A middleware that turns an ``HTTPException`` of status >= 400 raised by aiohttp or a handler
    into ``render(status, "<reason>: <method> <path>")``; redirects and successes pass through."""

    @web.middleware
    async def json_errors(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return render(e.status, f"{e.reason}: {request.method} {request.path}")

    return json_errors
