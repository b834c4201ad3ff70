"""The router's spans of one request (``--enable-trace``; engine/tracing.py).

``router.request`` (under the client's ``traceparent``) holds ``router.queue`` (the admission
wait), ``router.route`` (choosing the pair, one per attempt) and one client span per leg,
``router.leg.prefill`` and ``router.leg.decode``, whose context goes to the worker as its
``traceparent``: the worker's ``server.request`` is the leg span's child.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.tracing import Tracer


class _Scope:
    """A span for the length of a ``with`` block (None inside when tracing is off), current in it
    when ``attach``. A plain class, not ``contextlib.contextmanager``: that one writes
    ``__traceback__`` on the exception passing through, which the router's frozen ``RouterError``
    refuses."""

    def __init__(self, tracer: Tracer | None, span: Any, parent: Any = None, attach: bool = False):
        self.tracer = tracer
        self.span = span
        self.token = tracer.attach(tracer.context_of(span, parent)) if attach else None

    def __enter__(self) -> Any:
        return self.span

    def __exit__(self, *exc) -> bool:
        if self.token is not None:
            self.tracer.detach(self.token)
        if self.span is not None:
            self.span.end()
        return False


def request_span(tracer: Tracer, headers, route: str) -> _Scope:
    """``router.request`` under the client's ``traceparent``, current in the block (the legs'
    tasks, made in it, inherit it)."""
    parent = tracer.extract(headers)
    span = tracer.start("router.request", parent, tracer.server_kind, attributes={"http.route": route})
    return _Scope(tracer, span, parent, attach=True)


_OFF = _Scope(None, None)  # tracing off: one scope that does nothing, shared by every request


def child_span(tracer: Tracer | None, name: str, attributes: dict | None = None) -> _Scope:
    """A span under the current one (``router.queue``, ``router.route``); None when tracing is off."""
    return _OFF if tracer is None else _Scope(tracer, tracer.start(name, attributes=attributes))


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
