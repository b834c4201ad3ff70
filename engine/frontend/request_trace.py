"""A server's spans of one request (``--enable-trace``; engine/tracing.py).

The middleware opens ``server.request`` under the caller's ``traceparent`` (the router's leg span,
or a client's) and makes it current while the handler runs, so the tokenizer manager captures it
when it submits. When a sequence finishes, ``record_sequence`` adds its stages from the times the
front end already keeps: tokenization; then, by role, the wait for the first token (queue and
prefill, KV transfer on a prefill server; KV transfer on a decode server) and decoding until finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.engine.frontend.seq_state import SeqState
from pdserve.engine.tracing import Tracer, monotonic_to_ns

TRACED_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
# the span of the time from submission to the first token, by --disaggregation-mode
FIRST_TOKEN_SPAN = {"prefill": "prefill.queue_prefill_kv_transfer", "decode": "decode.kv_transfer_wait",
                    "null": "queue_and_prefill"}


@dataclass
class SeqTrace:
    """What a sequence's spans need from its submission: the parent context and tokenization's times."""

    parent: Any
    tokenize_start: float
    tokenize_end: float


def trace_middleware(tracer: Tracer, mode: str):
    """The aiohttp middleware that opens a request's server span (inference routes only)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path not in TRACED_PATHS:
            return await handler(request)
        parent = tracer.extract(request.headers)
        span = tracer.start("server.request", parent, tracer.server_kind,
                            attributes={"pdserve.role": mode, "http.route": request.path})
        token = tracer.attach(tracer.context_of(span, parent))
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            tracer.detach(token)
            span.set_attribute("http.status_code", status)
            span.end()

    return middleware


def record_sequence(tracer: Tracer, st: SeqState, trace: SeqTrace, mode: str) -> None:
    """The finished sequence ``st``'s stage spans under its request's server span."""
    end = st.finished_time if st.finished_time is not None else trace.tokenize_end
    attrs = {"pdserve.rid": st.rid, "pdserve.prompt_tokens": st.prompt_tokens,
             "pdserve.completion_tokens": st.completion_tokens, "pdserve.cached_tokens": st.cached_tokens,
             "pdserve.finish_reason": st.finish_reason or ""}
    if st.spec.bootstrap is not None:
        attrs["pdserve.bootstrap_room"] = str(st.spec.bootstrap.room)
    if st.dp_rank is not None:
        attrs["pdserve.dp_rank"] = st.dp_rank
    if st.error:
        attrs["pdserve.error"] = st.error
    tracer.record("tokenize", trace.parent, monotonic_to_ns(trace.tokenize_start), monotonic_to_ns(trace.tokenize_end),
                  {"pdserve.prompt_tokens": len(st.input_ids)})
    first = st.first_token_time if st.first_token_time is not None else end
    tracer.record(FIRST_TOKEN_SPAN.get(mode, "queue_and_prefill"), trace.parent,
                  monotonic_to_ns(trace.tokenize_end), monotonic_to_ns(first), attrs)
    if mode != "prefill" and st.first_token_time is not None:
        tracer.record("decode", trace.parent, monotonic_to_ns(first), monotonic_to_ns(end),
                      {"pdserve.completion_tokens": st.completion_tokens})
