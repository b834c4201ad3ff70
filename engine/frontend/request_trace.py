"""A server's spans of one request (``--enable-trace``; engine/tracing.py).

The middleware opens ``server.request`` under the caller's ``traceparent`` (the router's leg span,
or a client's) and makes it current while the handler runs, so the tokenizer manager captures it
when it submits. When a sequence finishes, ``record_sequence`` adds its stages from the times the
front end already keeps: tokenization; then, by role, the wait for the first token (queue and
prefill, KV transfer on a prefill server; KV transfer on a decode server), decoding and streaming
until finish; and, as children of the same server span, the stages the scheduler rank recorded
(``StageTimeline``, ``engine/sched/stage_recorder.py``): queue waits, each prefill chunk, the KV
transfer with its bytes, the decode's preallocation and its sampled steps. The server span itself
gets the prompt's tokens by the cache tier that served them (``prompt_tier_counts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.engine.frontend.seq_state import SeqState
from pdserve.engine.messages import StageTimeline
from pdserve.engine.tracing import Tracer, monotonic_to_ns

TRACED_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
# the span of the time from submission to the first token, by --disaggregation-mode
FIRST_TOKEN_SPAN = {"prefill": "prefill.queue_prefill_kv_transfer", "decode": "decode.kv_transfer_wait",
                    "null": "queue_and_prefill"}


@dataclass
class SeqTrace:
    """What a sequence's spans need: the parent context and tokenization's times from its submission,
    the rank's stage timeline from its final output, the detokenizer's time from each output."""

    parent: Any
    tokenize_start: float
    tokenize_end: float
    stages: StageTimeline | None = None
    detokenize_s: float = 0.0
    num_outputs: int = 0


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
        tracer.record("stream", trace.parent, monotonic_to_ns(first), monotonic_to_ns(end),
                      {"pdserve.outputs": trace.num_outputs,
                       "pdserve.detokenize_ms": round(trace.detokenize_s * 1e3, 3)})
    if trace.stages is not None:
        record_stages(tracer, trace.parent, trace.stages, mode, attrs.get("pdserve.bootstrap_room"))
    tracer.add_counts(trace.parent, prompt_tier_counts(st, trace.stages, mode))


def prompt_tier_counts(st: SeqState, stages: StageTimeline | None, mode: str) -> dict[str, int]:
    """The server span's account of the sequence's prompt tokens: served from the KV pool's radix
    cache (``device``), loaded from the host tier or from what the storage tier fetched, and
    computed. A PD decode server computes none and knows only the total its prefill server
    reported as cached (``pdserve.cached_tokens``); its own local prefills are split like any."""
    prompt, cached = st.prompt_tokens, st.cached_tokens
    counts = {"pdserve.prompt_tokens": prompt, "pdserve.cached_tokens": cached}
    if mode == "decode" and st.spec.bootstrap is not None:
        return counts
    host = stages.cached_host_tokens if stages is not None else 0
    storage = stages.cached_storage_tokens if stages is not None else 0
    counts |= {"pdserve.cached_tokens.device": cached - host - storage, "pdserve.cached_tokens.host": host,
               "pdserve.cached_tokens.storage": storage, "pdserve.computed_prompt_tokens": prompt - cached}
    return counts


def stage_spans(tl: StageTimeline, mode: str) -> list[tuple[str, float, float, dict]]:
    """The spans of a rank's stage timeline, as (name, start, end, attributes) on ``time.monotonic``:
    the wait before the first forward (prefill: for the decode's destination, then in the queue;
    decode: for preallocation), each prefill chunk, the KV transfer, the sampled decode steps."""
    out: list[tuple[str, float, float, dict]] = []
    first_compute = tl.chunks[0][0] if tl.chunks else tl.steps[0][0] if tl.steps else tl.finished
    dp = {"pdserve.dp_rank": tl.dp_rank}
    if mode == "prefill":
        if tl.bootstrapped is not None:
            out.append(("prefill.bootstrap_wait", tl.enqueued, tl.bootstrapped, dp))
        if first_compute is not None:
            out.append(("prefill.queue", tl.bootstrapped or tl.enqueued, first_compute, dp))
    elif mode == "decode" and tl.prealloc_done is not None:
        out.append(("decode.prealloc", tl.enqueued, tl.prealloc_done, dp))
    elif first_compute is not None:  # colocated, or a decode server's local prefill
        out.append(("queue", tl.enqueued, first_compute, dp))
    for i, (start, end, tokens) in enumerate(tl.chunks):
        out.append(("prefill.chunk", start, end, {"pdserve.chunk": i, "pdserve.chunk_tokens": tokens}))
    if tl.transfer_start is not None and tl.transfer_end is not None:
        out.append((f"{mode}.kv_transfer", tl.transfer_start, tl.transfer_end,
                    {"pdserve.kv_bytes": tl.transfer_bytes, "pdserve.transfer_backend": tl.transfer_backend}))
    for start, end, k in tl.steps:
        out.append(("decode.first_step" if k == 0 else "decode.step", start, end,
                    {"pdserve.step": k, "pdserve.decode_steps": tl.num_steps}))
    return out


def record_stages(tracer: Tracer, parent: Any, tl: StageTimeline, mode: str, room: str | None) -> None:
    """The timeline's spans, children of the request's server span."""
    for name, start, end, attrs in stage_spans(tl, mode):
        if room is not None and name.endswith("kv_transfer"):
            attrs = {**attrs, "pdserve.bootstrap_room": room}
        if tl.num_retractions and name == "decode.first_step":
            attrs = {**attrs, "pdserve.retractions": tl.num_retractions}
        tracer.record(name, parent, monotonic_to_ns(start), monotonic_to_ns(end), attrs)
