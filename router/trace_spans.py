"""The router's spans of one request (``--enable-trace``; engine/tracing.py).

``router.request`` (under the client's ``traceparent``) holds ``router.queue`` (the admission
wait), ``router.route`` (choosing the pair, one per attempt) and one client span per leg,
``router.leg.prefill`` and ``router.leg.decode``, whose context goes to the worker as its
``traceparent``: the worker's ``server.request`` is the leg span's child.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from pdserve.engine.tracing import Tracer


@contextlib.contextmanager
def request_span(tracer: Tracer | None, headers, route: str) -> Iterator[Any]:
    """``router.request``, current while the request is served (its legs' tasks inherit it);
    yields the span (None when tracing is off)."""
    if tracer is None:
        yield None
        return
    parent = tracer.extract(headers)
    span = tracer.start("router.request", parent, tracer.server_kind, attributes={"http.route": route})
    token = tracer.attach(tracer.context_of(span, parent))
    try:
        yield span
    finally:
        tracer.detach(token)
        span.end()


@contextlib.contextmanager
def child_span(tracer: Tracer | None, name: str, **attributes) -> Iterator[Any]:
    """A span under the current one (``router.queue``, ``router.route``); None when tracing is off."""
    if tracer is None:
        yield None
        return
    span = tracer.start(name, attributes=attributes or None)
    try:
        yield span
    finally:
        span.end()


def leg_span(tracer: Tracer | None, leg: str, endpoint_key: str) -> tuple[Any, bytes]:
    """A started ``router.leg.<leg>`` client span and the header lines that continue it on the
    worker; ``(None, b"")`` when tracing is off. The caller ends the span."""
    if tracer is None:
        return None, b""
    span = tracer.start(f"router.leg.{leg}", kind=tracer.client_kind,
                        attributes={"pdserve.leg": leg, "pdserve.worker": endpoint_key})
    lines = "".join(f"{k}: {v}\r\n" for k, v in tracer.headers(tracer.context_of(span)).items())
    return span, lines.encode("latin-1")


def end_leg(span: Any, status: int | None = None, error: str | None = None) -> None:
    """End a leg span (if any) with the worker's status or the failure."""
    if span is None:
        return
    if status is not None:
        span.set_attribute("http.status_code", status)
    if error is not None:
        span.set_attribute("pdserve.error", error)
    span.end()
