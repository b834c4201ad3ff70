"""The hostile mix of ``scripts/soak.py --hostile``: requests a stranger who can reach the router
sends to stall, crash or starve it, each with the answers that are correct for it.

Each kind is one request: a builder makes its bytes (pure, tested without servers), and
``send_hostile`` sends them over a raw socket, so that a body can be trickled, a stream read
slowly, or a body larger than the router accepts cut off when the router answers. The outcome is
the HTTP status, ``hung`` (no answer within the deadline) or ``closed`` (the connection closed
with no status line).
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.engine.frontend.grammar_fields import MAX_GRAMMAR_CHARS
from pdserve.engine.frontend.value_checks import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from pdserve.engine.http_limits import MAX_REQUEST_BYTES

# over the router's default max_payload_size and the engine's --max-request-bytes (the same number)
OVERSIZED_BYTES = MAX_REQUEST_BYTES + 1024 * 1024
HUGE_PROMPT_CHARS = MAX_REQUEST_BYTES // 2  # under both body limits, far over any context
TRICKLE_BYTES, TRICKLE_GAP_S = 16, 0.5  # a slow client's body: 16 bytes every half second
SLOW_READ_BYTES, SLOW_READ_GAP_S = 256, 0.25  # a slow reader: 256 bytes every quarter second


@dataclass(frozen=True)
class HostileRequest:
    """One hostile request: what to send and how, and which answers are correct.

    ``body`` is sent whole, or trickled (``trickle``), or, when ``declared_length`` is set, only
    ``body`` is sent under a Content-Length of ``declared_length``; ``chunked_total`` sends that
    many body bytes with chunked encoding instead (no length up front). ``slow_read``: the reply is
    read a little at a time through a small receive buffer."""

    kind: str
    method: str
    path: str
    body: bytes
    allowed: frozenset[int]
    headers: tuple[tuple[str, str], ...] = ()
    declared_length: int | None = None
    chunked_total: int | None = None
    trickle: bool = False
    slow_read: bool = False


def _gen(ids_or_text, max_new: int = 4, **sp) -> dict:
    key = "text" if isinstance(ids_or_text, str) else "input_ids"
    return {key: ids_or_text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **sp}}


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def deep_schema(depth: int) -> dict:
    """An object schema nested ``depth`` levels (small text, deep grammar)."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def wide_schema(chars: int) -> dict:
    """An object schema whose text is at least ``chars`` characters (over the grammar cap)."""
    n = chars // 40 + 1
    return {"type": "object", "properties": {f"property_{i:07d}": {"type": "integer"} for i in range(n)}}


REGEX_BOMB = "(" + "|".join(f"(a{{1,64}}b{{1,64}}){{1,{k}}}" for k in range(16, 48)) + ")*"

CLIENT_ERROR = frozenset(range(400, 500))
OK_OR_CLIENT_ERROR = CLIENT_ERROR | {200}


def hostile_requests(decode_url: str) -> list[HostileRequest]:
    """Every kind of the hostile mix, once. ``decode_url``: a worker a stranger tries to remove."""
    ids = list(range(100, 132))
    ok_or_413 = frozenset({413})
    stops_long = [chr(ord("A") + i % 26) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]
    return [
        HostileRequest("oversized_declared", "POST", "/generate", _json(_gen(ids)) + b" " * 65536, ok_or_413,
                       declared_length=OVERSIZED_BYTES),
        HostileRequest("oversized_chunked", "POST", "/generate", b"", ok_or_413, chunked_total=OVERSIZED_BYTES),
        HostileRequest("huge_prompt", "POST", "/generate", _json(_gen("hi " * (HUGE_PROMPT_CHARS // 3))),
                       CLIENT_ERROR),
        HostileRequest("schema_over_cap", "POST", "/generate",
                       _json(_gen(ids, json_schema=json.dumps(wide_schema(MAX_GRAMMAR_CHARS + 1024)))), CLIENT_ERROR),
        HostileRequest("schema_deep", "POST", "/generate", _json(_gen(ids, json_schema=json.dumps(deep_schema(400)))),
                       CLIENT_ERROR),
        HostileRequest("regex_bomb", "POST", "/generate", _json(_gen(ids, regex=REGEX_BOMB)), OK_OR_CLIENT_ERROR),
        HostileRequest("stop_too_many", "POST", "/generate",
                       _json(_gen(ids, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])), CLIENT_ERROR),
        HostileRequest("stop_too_long", "POST", "/generate", _json(_gen(ids, stop=["x" * (MAX_STOP_STRING_CHARS * 20)])),
                       CLIENT_ERROR),
        HostileRequest("stop_at_cap", "POST", "/generate", _json(_gen(ids, 16, stop=stops_long, ignore_eos=True)),
                       frozenset({200})),
        HostileRequest("n_too_large", "POST", "/v1/completions",
                       _json({"prompt": "hello", "max_tokens": 4, "n": 10_000}), CLIENT_ERROR),
        HostileRequest("bogus_worker_add", "POST", "/workers",
                       _json({"url": "http://169.254.169.254:80", "role": "prefill"}), frozenset({401, 403})),
        HostileRequest("bogus_worker_remove", "DELETE", "/workers/" + decode_url.replace("/", "%2F"), b"",
                       frozenset({401, 403})),
        HostileRequest("slow_body", "POST", "/generate", _json(_gen(ids)), frozenset({200, 408}), trickle=True),
        HostileRequest("slow_read", "POST", "/generate", _json(_gen(ids, 48, ignore_eos=True) | {"stream": True}),
                       frozenset({200}), slow_read=True),
    ]


def request_head(req: HostileRequest, host: str) -> bytes:
    """The request line and headers (``Connection: close``: the reply ends at EOF)."""
    lines = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if req.method != "GET":
        lines.append("Content-Type: application/json")
    if req.chunked_total is not None:
        lines.append("Transfer-Encoding: chunked")
    else:
        lines.append(f"Content-Length: {req.declared_length or len(req.body)}")
    lines += [f"{k}: {v}" for k, v in req.headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(reply: bytes) -> int | None:
    """The status code of a raw HTTP reply; None without a status line."""
    first = reply.split(b"\r\n", 1)[0].split()
    if len(first) >= 2 and first[0].startswith(b"HTTP/") and first[1].isdigit():
        return int(first[1])
    return None


async def _write_body(req: HostileRequest, writer: asyncio.StreamWriter) -> None:
    if req.chunked_total is not None:
        piece = b"x" * 65536
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        for _ in range(req.chunked_total // len(piece) + 1):
            writer.write(chunk)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
    elif req.trickle:
        for i in range(0, len(req.body), TRICKLE_BYTES):
            writer.write(req.body[i:i + TRICKLE_BYTES])
            await writer.drain()
            await asyncio.sleep(TRICKLE_GAP_S)
    else:
        writer.write(req.body)
    await writer.drain()


def reply_complete(reply: bytes) -> bool:
    """Whether ``reply`` holds its headers and the whole body its Content-Length announces (a
    refusal: the server may keep the connection open to drain a body it will not read)."""
    head, sep, body = reply.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value.strip())
    return False


async def _read_reply(req: HostileRequest, reader: asyncio.StreamReader, got_status: asyncio.Event) -> bytes:
    reply = b""
    while True:
        chunk = await reader.read(SLOW_READ_BYTES if req.slow_read else 65536)
        if not chunk:
            return reply
        reply += chunk
        if status_of(reply) is not None:
            got_status.set()
        if reply_complete(reply):
            return reply
        if req.slow_read:
            await asyncio.sleep(SLOW_READ_GAP_S)


async def send_hostile(url: str, req: HostileRequest, deadline: float = 120.0) -> str:
    """Send ``req`` to ``url`` (http://host:port); the outcome: the status code as text, ``hung``
    or ``closed``. The body is written while the reply is read, so that an early 413 ends it."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    if req.slow_read:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reply = b""
    try:
        await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    except OSError:
        sock.close()
        return "closed"
    got_status = asyncio.Event()

    async def write_all():
        try:
            writer.write(request_head(req, parts.netloc))
            await _write_body(req, writer)
        except (ConnectionError, OSError):
            pass  # the server answered and closed while the body was still going out

    async def exchange():
        nonlocal reply
        w = asyncio.create_task(write_all())
        try:
            reply = await _read_reply(req, reader, got_status)
        except (ConnectionError, OSError):
            pass
        finally:
            w.cancel()

    try:
        await asyncio.wait_for(exchange(), deadline)
    except asyncio.TimeoutError:
        status = status_of(reply)
        return "hung" if status is None or req.slow_read else str(status)
    finally:
        writer.close()
    status = status_of(reply)
    return "closed" if status is None else str(status)


def is_allowed(req: HostileRequest, outcome: str) -> bool:
    """Whether ``outcome`` is a correct answer to ``req`` (never a 5xx, never hung)."""
    return outcome.isdigit() and int(outcome) in req.allowed
