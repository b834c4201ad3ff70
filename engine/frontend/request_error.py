"""Error mapping of the request path: ``RequestError``, and msgspec's decoding errors turned into it.

Every failure of a request body is a ``RequestError`` (a ``ValueError``) carrying the HTTP status and
the OpenAI error object's fields, so a typo such as ``max_token`` is a 400 naming it.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec


class RequestError(ValueError):
    """A bad request, answered with OpenAI's error object (the offline Engine raises it as it is)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")


_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?(.*)`)?")


def _invalid_body(e: msgspec.ValidationError) -> RequestError:
    """msgspec's validation error as a RequestError naming the field."""
    msg = str(e)
    m = _UNKNOWN_RE.match(msg)
    if m:
        name = m.group(1) if not m.group(2) else f"{m.group(2)}.{m.group(1)}"
        return RequestError(f"Unknown field `{name}` in the request body", param=name, code="unknown_field")
    m = _PATH_RE.search(msg)
    param = m.group(1) if m else None
    return RequestError(f"Invalid request body: {msg}", param=param, code="invalid_type")


def decode_body(body: bytes, type_: type[msgspec.Struct]) -> msgspec.Struct:
    """Decode a JSON body, turning msgspec's errors into RequestErrors naming the field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise _invalid_body(e) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"Invalid JSON body: {e}", code="invalid_json") from None


def convert_body(obj: dict[str, Any], type_: type[msgspec.Struct]) -> msgspec.Struct:
    """A body given as Python objects (the offline Engine's arguments), checked as ``decode_body`` checks JSON."""
    try:
        return msgspec.convert(msgspec.to_builtins(obj), type_)
    except msgspec.ValidationError as e:
        raise _invalid_body(e) from None
    except TypeError as e:  # an object with no JSON form
        raise RequestError(f"Invalid request body: {e}", code="invalid_type") from None
