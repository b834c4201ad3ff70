"""Errors the router answers with: typed values that become one JSON shape.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's shape; ``code`` is the HTTP status, as SGLang's servers send it).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from aiohttp import web

_encode = msgspec.json.encode


@dataclass(frozen=True)
class RouterError(Exception):
    status: int
    message: str
    type: str = "internal_error"
    param: str | None = None
    retry_after: int | None = None  # seconds, sent as the Retry-After header

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.type, self.param)


def error_response(err: RouterError) -> web.Response:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return web.Response(body=err.body(), status=err.status, content_type="application/json",
                        headers=headers)


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": type_, "param": param, "code": status}})


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param)


def unauthorized() -> RouterError:
    return RouterError(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')",
                       "authentication_error")


def payload_too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body is larger than --max-payload-size ({limit} bytes)",
                       "payload_too_large")


def too_many_requests(message: str) -> RouterError:
    return RouterError(429, message, "rate_limit_error")


def no_workers(role: str) -> RouterError:
    return RouterError(503, f"no healthy {role} worker available", "service_unavailable")


def upstream_failed(message: str) -> RouterError:
    return RouterError(502, message, "upstream_error")
