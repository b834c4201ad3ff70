"""The request path: send one client request to a prefill and a decode leg at the same time.

For each attempt a new pair and a new room are chosen. Before the first byte
has gone to the client, a failed leg cancels the other and the request is
retried on a new pair (bounded attempts, exponential backoff with jitter); the
last failure becomes a 502 JSON error. After streaming has begun, a failed
decode stream ends with an SSE error event, unless it can be migrated
(``--migration-limit``, router/migration/migrating_relay.py). A client that goes away cancels
both legs (closing their connections, which is what servers watch for to
abort the room).

Conditional disaggregation (``--local-prefill-max-tokens N``,
``--prefill-queue-threshold Q``; the rule is ``router/local_prefill.py``): a
single prompt whose part uncached on the chosen decode worker is at most N
tokens (the request is tokenized once, by a policy's tokenizer or the router's own, and the
prefill policy's cache view says what is uncached, so with ``kv_aware``), or
any single prompt while every prefill queue is above Q, goes to that decode
worker alone, without bootstrap fields, and it prefills the prompt itself
(``--max-local-prefill-tokens`` there). A worker that
refuses (too long for it, full, down) costs one attempt: the request then takes
the prefill/decode path. Every answer names its route in the headers
``x-pdserve-prefill`` (the prefill endpoint, or ``local``) and
``x-pdserve-decode``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from pdserve.engine.tracing import Tracer
from pdserve.router.config import RouterConfig, backoff_ms
from pdserve.router.errors import RouterError, upstream_failed
from pdserve.router.leg_failure import LegFailure
from pdserve.router.local_prefill import LocalReason, local_prefill_reason
from pdserve.router.migration.migrating_relay import MigratingRelay
from pdserve.router.migration.migration import error_event, migratable
from pdserve.router.migration.openai_migration import openai_migratable, with_token_ids
from pdserve.router.route import LocalRule, RouteQuery
from pdserve.router.trace_spans import child_span, end_leg, leg_span
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers.pairing import Pair, Pairing, batch_size
from pdserve.router.workers.request_tokens import request_tokens
from pdserve.router.upstream import TOO_LARGE, UpstreamError, UpstreamPool, UpstreamResponse, drain_response
from pdserve.router.workers.adapter_sync import AdapterSync
from pdserve.router.workers.worker_registry import Endpoint

log = logging.getLogger("pdserve.router")

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_DONE = b"data: [DONE]\n\n"


LOCAL = "local"  # x-pdserve-prefill of a request the decode worker prefilled itself
# a 200 answer carrying an error: on a prefill leg, its room failed (a KV transfer fault, a timeout)
ERROR_IN_ANSWER = "error_in_answer"


def route_headers(pair: Pair | None, decode: Endpoint | None = None) -> dict[str, str]:
    """The response headers naming a request's route (``pair`` None: a local prefill on ``decode``)."""
    if pair is None:
        return {"x-pdserve-prefill": LOCAL, "x-pdserve-decode": decode.key}
    return {"x-pdserve-prefill": pair.prefill.key, "x-pdserve-decode": pair.decode.key}


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # mark retrieved: the failure was handled through another path


class PDProxy:
    def __init__(self, config: RouterConfig, pairing: Pairing, metrics: RouterMetrics,
                 upstream: UpstreamPool, tracer: Tracer | None = None, adapters: AdapterSync | None = None):
        """``adapters``: loads a request's LoRA adapters where they are missing (None: never)."""
        self.config = config
        self.adapters = adapters
        self.tracer = tracer  # --enable-trace: spans of routing and of each leg; None: off
        self.pairing = pairing
        self.metrics = metrics
        self.upstream = upstream  # pooled connections to the workers (sends --api-key as bearer)
        self._rng = random.Random()
        self.background: set[asyncio.Task] = set()  # prefill legs outliving their stream
        self._local_in_flight: dict[str, int] = {}  # decode endpoint key -> local prefills in flight

    async def handle(self, request: web.Request, path: str, body: dict,
                     t0: float) -> web.StreamResponse:
        """Serve one client request; raises RouterError for errors before the first byte."""
        stream = bool(body.get("stream"))
        attempts = self.config.retry_max_retries
        exclude: set[str] = set()
        last: LegFailure | None = None
        query = self.pairing.query(body)  # the request read (and tokenized) once
        rules = self._local_rules(body)
        cost = request_tokens(body, query.prompt_tokens)  # what it holds on each leg's DP rank
        with child_span(self.tracer, "router.route", self._route_attributes(0)) as span:
            route = self.pairing.route(query, local=rules)
            _describe(span, route)
        attempt = 0
        while route.local:
            d_ep = route.decode
            self.metrics.local_reasons.inc(route.local_reason.value)
            log.debug("route: local prefill on decode %s (%s: %s uncached tokens)",
                      d_ep.key, route.local_reason.value, route.uncached_tokens)
            try:
                await self._load_adapters(route, query)
                return await self._attempt_local(request, path, body, stream, t0, d_ep, cost.decode)
            except LegFailure as failure:
                self.metrics.leg_errors.inc(failure.endpoint.worker.url, failure.leg)
                if route.local_reason is LocalReason.COLOCATED:
                    # a colocated worker failed: another one, as the prefill/decode path retries
                    attempt += 1
                    if not failure.retryable:
                        return _passthrough_error(failure)
                    if attempt >= attempts:
                        raise upstream_failed(f"request failed after {attempts} attempt(s); last: "
                                              f"{failure.describe()}") from None
                    exclude.add(failure.endpoint.key)
                    await self._before_retry(attempt, failure)
                    route = self.pairing.route(query, exclude, local=rules)
                    continue
                # refused (too long for it, full) or failed: the prefill/decode path serves it
                self.metrics.prefills.inc("local_refused")
                log.info("local prefill refused, via a prefill worker: %s", failure.describe())
                route = self.pairing.route(query)
        for attempt in range(attempts):
            if attempt:
                await self._before_retry(attempt, last)
                with child_span(self.tracer, "router.route", self._route_attributes(attempt, last.cause)) as span:
                    route = self.pairing.route(query, exclude)
                    _describe(span, route)
            pair = Pair(route.prefill, route.decode, route.room, cost.prefill, cost.decode)
            log.debug("route: prefill %s, decode %s", pair.prefill.key, pair.decode.key)
            await self._load_adapters(route, query)
            try:
                if stream:
                    return await self._attempt_stream(request, path, body, pair, t0)
                return await self._attempt_json(path, body, pair, t0)
            except LegFailure as failure:
                self.metrics.leg_errors.inc(failure.endpoint.worker.url, failure.leg)
                log.info("attempt %d/%d failed: %s", attempt + 1, attempts, failure.describe())
                if not failure.retryable:
                    return _passthrough_error(failure)
                exclude.add(failure.endpoint.key)
                last = failure
        raise upstream_failed(f"request failed after {attempts} attempt(s); last: {last.describe()}")

    async def _before_retry(self, attempt: int, last: LegFailure) -> None:
        """Count retry ``attempt`` after ``last`` failed, and wait its backoff."""
        self.metrics.retries.inc()
        self.metrics.leg_retries.inc(last.endpoint.worker.url, last.leg)
        self.metrics.retries_by_cause.inc(last.leg, last.cause)
        await asyncio.sleep(backoff_ms(self.config, attempt, self._rng.random()) / 1000.0)

    # LoRA adapters ---------------------------------------------------------
    async def _load_adapters(self, route, query: RouteQuery) -> None:
        """Load the request's adapters on the workers of ``route`` that lack them
        (``--lora-load-on-demand``); a failed load is the RouterError it raises."""
        if self.adapters is None or not query.adapters or not self.config.lora_load_on_demand:
            return
        workers = [route.decode.worker] + ([] if route.prefill is None else [route.prefill.worker])
        await self.adapters.ensure(workers, query.adapters)

    # a local prefill ------------------------------------------------------
    def _local_allowed(self, body: dict) -> bool:
        """Conditional disaggregation is on and ``body`` is a single request (a batch never goes local)."""
        c = self.config
        return bool(c.local_prefill_max_tokens or c.prefill_queue_threshold) and batch_size(body) is None

    def _local_rules(self, body: dict) -> Callable[[Endpoint], LocalRule | None] | None:
        """What lets a decode endpoint serve ``body`` alone: a colocated worker always, a decode
        worker under conditional disaggregation; None when neither can."""
        single = self._local_allowed(body)
        if not single and not self.pairing.registry.serves_alone:
            return None
        return lambda d_ep: self._local_rule(d_ep, single)

    def _local_rule(self, d_ep: Endpoint, single: bool = True) -> LocalRule | None:
        """The rule that lets ``d_ep`` prefill a request itself; None when it accepts no local
        prefill (it would refuse a request without bootstrap fields: warned at registration).
        ``single``: conditional disaggregation is on and the request is a single one."""
        if d_ep.worker.colocated:
            return _colocated
        if not single:
            return None
        accepts = d_ep.worker.max_local_prefill_tokens
        if not accepts:
            return None
        c = self.config

        def rule(uncached: int | None, whole: int | None) -> LocalReason | None:
            if whole is not None and whole > accepts:
                return None  # the worker checks the whole prompt against its limit: it would refuse it
            prefill_loads = [e.load for e in self.pairing.registry.healthy_endpoints("prefill")]
            return local_prefill_reason(uncached if c.local_prefill_max_tokens else None,
                                        c.local_prefill_max_tokens, prefill_loads,
                                        c.prefill_queue_threshold, self._local_in_flight.get(d_ep.key, 0))
        return rule

    async def _attempt_local(self, request: web.Request, path: str, body: dict, stream: bool,
                             t0: float, d_ep: Endpoint, tokens: int) -> web.StreamResponse:
        """The request on ``d_ep`` (``tokens`` in flight there), prefilled there; raises LegFailure.
        Until its first byte it counts as a local prefill in flight on ``d_ep`` (the queue rule's
        measure of room)."""
        data = Pairing.local_body(body)
        headers = route_headers(None, d_ep)
        key = d_ep.key
        self._local_in_flight[key] = self._local_in_flight.get(key, 0) + 1
        prefilling = True

        def prefilled() -> None:
            nonlocal prefilling
            if prefilling:
                prefilling = False
                self._local_in_flight[key] -= 1
                if not self._local_in_flight[key]:
                    del self._local_in_flight[key]

        try:
            if stream:
                d_ep.begin(tokens)
                resp = None
                try:
                    resp, chunk = await self.open_stream(d_ep, path, data)
                    prefilled()
                    self.metrics.prefills.inc(LOCAL)
                    out, draining = await self._relay(request, resp, chunk, d_ep, t0, headers)
                    if not draining:
                        resp.close()
                    return out
                except BaseException:
                    if resp is not None:
                        resp.close()
                    raise
                finally:
                    d_ep.end(tokens)
            status, ctype, payload = await self.leg("decode", d_ep, path, data, tokens)
        finally:
            prefilled()
        if _has_error(payload):
            raise LegFailure("decode", d_ep, f"error in answer: {_short(payload)}", 500, cause=ERROR_IN_ANSWER)
        self.metrics.prefills.inc(LOCAL)
        self.metrics.ttft.observe(time.perf_counter() - t0)
        return web.Response(body=payload, status=status, content_type=ctype or "application/json",
                            headers=headers)

    def _route_attributes(self, attempt: int, retry_cause: str | None = None) -> dict | None:
        """The ``router.route`` span's first attributes; None (nothing built) when tracing is off."""
        if self.tracer is None:
            return None
        out: dict = {"pdserve.attempt": attempt}
        if attempt:
            out["pdserve.retry_cause"] = retry_cause or ""
        return out

    # one attempt, JSON answer ---------------------------------------------
    async def _attempt_json(self, path: str, body: dict, pair: Pair, t0: float) -> web.Response:
        p_body, d_body = Pairing.leg_bodies(body, pair)
        # the prefill leg in a task of its own, the decode leg awaited here (one task per request
        # fewer than a task per leg, on the router's busiest path); a prefill failure while the
        # decode leg is out cancels this task, which then raises that failure
        p_task = asyncio.ensure_future(self.leg("prefill", pair.prefill, path, p_body, pair.prefill_tokens))
        me = asyncio.current_task()
        decode_out = True
        interrupted = False

        def prefill_done(t: asyncio.Task) -> None:
            nonlocal interrupted
            if decode_out and not t.cancelled() and t.exception() is not None:
                interrupted = True
                me.cancel()

        p_task.add_done_callback(prefill_done)
        try:
            try:
                status, ctype, d_data = await self.leg("decode", pair.decode, path, d_body, pair.decode_tokens)
                decode_out = False
                _, _, p_data = await p_task
            except asyncio.CancelledError:
                # cancelled by the prefill leg's failure alone (not also by the client): raise it
                if interrupted and me.uncancel() == 0:
                    raise p_task.exception() from None
                raise
        finally:
            decode_out = False
            if not p_task.done():
                p_task.cancel()
            p_task.add_done_callback(_consume)
        if body.get("return_logprob") and path == "/generate":
            d_data = merge_input_logprobs(p_data, d_data)
        self.metrics.ttft.observe(time.perf_counter() - t0)  # a JSON answer's first byte is all of it
        self.metrics.prefills.inc("remote")
        return web.Response(body=d_data, status=status, content_type=ctype or "application/json",
                            headers=route_headers(pair))

    async def leg(self, leg: str, ep: Endpoint, path: str, data: bytes, tokens: int = 0) -> tuple[int, str, bytes]:
        """POST one leg (``tokens`` in flight on ``ep`` meanwhile) and read its whole answer;
        raises LegFailure."""
        url = ep.worker.url
        self.metrics.leg_requests.inc(url, leg)
        t0 = time.perf_counter()
        span, trace_headers = leg_span(self.tracer, leg, ep.key)
        ep.begin(tokens)
        resp = None
        try:
            resp = await self.upstream.post(url, path, data, trace_headers)
            payload = await resp.read()
        except UpstreamError as e:
            end_leg(span, error=str(e))
            span = None
            _refuse_too_large(leg, ep, e)
            raise LegFailure(leg, ep, str(e), cause=e.cause) from None
        finally:
            ep.end(tokens)
            if resp is not None:
                resp.close()  # no-op when read; aborts the connection when cancelled
            end_leg(span, resp.status if resp is not None else None)
        if resp.status >= 400:
            raise LegFailure(leg, ep, f"HTTP {resp.status}: {_short(payload)}", resp.status,
                             payload, resp.content_type)
        if leg == "prefill" and _has_error(payload):
            raise LegFailure(leg, ep, f"error in answer: {_short(payload)}", 500, cause=ERROR_IN_ANSWER)
        self.metrics.leg_latency[leg].observe(time.perf_counter() - t0)
        return resp.status, resp.content_type, payload

    # one attempt, streamed answer -------------------------------------------
    async def _attempt_stream(self, request: web.Request, path: str, body: dict, pair: Pair,
                              t0: float) -> web.StreamResponse:
        migrating = bool(self.config.migration_limit) and (migratable(path, body) or openai_migratable(path, body))
        # an OpenAI stream's chunks carry the token ids a migration needs (the relay strips them)
        leg_body = with_token_ids(body) if migrating and path != "/generate" else body
        p_body, d_body = Pairing.leg_bodies(leg_body, pair)
        d_ep = pair.decode
        p_task = asyncio.ensure_future(self.leg("prefill", pair.prefill, path, p_body, pair.prefill_tokens))
        d_task = asyncio.ensure_future(self.open_stream(d_ep, path, d_body))
        d_start = time.perf_counter()
        d_ep.begin(pair.decode_tokens)
        resp: UpstreamResponse | None = None
        finished = draining = False
        try:
            resp, chunk = await self.first_bytes(p_task, d_task)
            self.metrics.prefills.inc("remote")
            if migrating:
                out, draining = await self._relay_migrating(request, resp, chunk, pair, path, body, t0)
            else:
                out, draining = await self._relay(request, resp, chunk, d_ep, t0, route_headers(pair))
            finished = True
            self.metrics.leg_latency["decode"].observe(time.perf_counter() - d_start)  # to the stream's end
            return out
        finally:
            d_ep.end(pair.decode_tokens)
            if resp is None and d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                resp = d_task.result()[0]
            if resp is not None and not draining:
                resp.close()  # no-op when fully read; otherwise drops the connection (cancels)
            for t in (p_task, d_task):
                # after a complete stream a prefill leg still answering is left to finish
                # (cancelling it would make the server abort a room that succeeded)
                if not t.done() and not (finished and t is p_task):
                    t.cancel()
                t.add_done_callback(_consume)
            if finished and not p_task.done():
                self.keep(p_task)

    def keep(self, task: asyncio.Future) -> None:
        """Keep ``task`` (a leg or a drain outliving its client's stream) until it ends;
        ``finish_background`` waits for it at shutdown."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def first_bytes(self, p_task: asyncio.Future, d_task: asyncio.Future) -> tuple[UpstreamResponse, bytes]:
        """Wait for the decode leg's first bytes (``open_stream``), unless the prefill leg fails
        first (its LegFailure is raised)."""
        pending = {p_task, d_task}
        while d_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None:
                raise p_task.exception()
        return d_task.result()

    async def finish_background(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the legs still answering after their client's stream
        ended (a shutdown would otherwise cut them, and a prefill server would abort a room that
        succeeded); returns how many are left."""
        if self.background:
            await asyncio.wait(set(self.background), timeout=timeout)
        return len(self.background)

    async def _relay(self, request: web.Request, resp: UpstreamResponse, chunk: bytes, d_ep: Endpoint,
                     t0: float, headers: dict[str, str]) -> tuple[web.StreamResponse, bool]:
        """Stream the decode leg's answer (from its first ``chunk``) to the client; returns the
        response and whether the upstream's end is being drained in the background."""
        out = web.StreamResponse(status=resp.status, headers={
            "Content-Type": resp.content_type or "text/event-stream", "Cache-Control": "no-cache", **headers})
        await out.prepare(request)  # the head goes out with the first chunk
        first = True
        draining = False
        try:
            while True:
                if resp.at_eof():  # the last chunk goes out with the stream's end
                    await out.write_eof(chunk)
                    break
                if chunk.endswith(_DONE):
                    # the stream is complete: end it now, so a client that closes on [DONE] has
                    # been answered in full (was: counted as a 499 disconnect in /metrics); the
                    # upstream's end is drained in the background (keeps its connection), where
                    # the client's close cannot cancel it
                    await out.write_eof(chunk)
                    self.keep(asyncio.ensure_future(drain_response(resp)))
                    draining = True
                    break
                await out.write(chunk)
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                    first = False
                chunk = await resp.readany()
                if not chunk:
                    await out.write_eof()
                    break
        except UpstreamError as e:
            self.metrics.leg_errors.inc(d_ep.worker.url, "decode")
            msg = f"decode worker {d_ep.key} failed mid-stream: {e}"
            log.warning(msg)
            await out.write_eof(error_event(msg))
        if first:
            self.metrics.ttft.observe(time.perf_counter() - t0)
        return out, draining

    async def _relay_migrating(self, request: web.Request, resp: UpstreamResponse, chunk: bytes, pair: Pair,
                               path: str, body: dict, t0: float) -> tuple[web.StreamResponse, bool]:
        """``_relay`` for a request that may be migrated (``--migration-limit``): continued on
        another pair if its decode leg fails mid-stream (router/migration/migrating_relay.py)."""
        relay = MigratingRelay(self, request, pair, path, body, t0)
        return await relay.run(resp, chunk, route_headers(pair))

    async def open_stream(self, ep: Endpoint, path: str, data: bytes):
        """POST the decode leg and wait for its first bytes: (response, first chunk)."""
        url = ep.worker.url
        self.metrics.leg_requests.inc(url, "decode")
        resp = None
        # the decode leg's span covers the request up to its first bytes (a stream outlives it)
        span, trace_headers = leg_span(self.tracer, "decode", ep.key)
        try:
            resp = await self.upstream.post(url, path, data, trace_headers)
            if resp.status >= 400:
                payload = await resp.read()
                raise LegFailure("decode", ep, f"HTTP {resp.status}: {_short(payload)}", resp.status,
                                 payload, resp.content_type)
            first = await resp.readany()
            if not first:
                raise LegFailure("decode", ep, "closed the stream before sending anything", cause="empty_stream")
            end_leg(span, resp.status)
            span = None
            return resp, first
        except UpstreamError as e:
            if resp is not None:
                resp.close()
            _refuse_too_large("decode", ep, e)
            raise LegFailure("decode", ep, str(e), cause=e.cause) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        finally:
            end_leg(span, error="failed before its first bytes")


def _colocated(uncached: int | None, whole: int | None) -> LocalReason:
    """The local rule of a colocated worker: it serves every request alone."""
    return LocalReason.COLOCATED


def _describe(span, route) -> None:
    """The chosen route as the ``router.route`` span's attributes (when tracing)."""
    if span is None:
        return
    span.set_attribute("pdserve.decode", route.decode.key)
    span.set_attribute("pdserve.prefill", LOCAL if route.local else route.prefill.key)
    if route.room is not None:
        span.set_attribute("pdserve.bootstrap_room", str(route.room))
    # the router's own count of the prompt and, where it asked (local prefill), what the decode
    # worker would compute of it; the servers' spans carry the measured split by cache tier
    if route.prompt_tokens is not None:
        span.set_attribute("pdserve.prompt_tokens", route.prompt_tokens)
    if route.uncached_tokens is not None:
        span.set_attribute("pdserve.decode_uncached_tokens", route.uncached_tokens)


def merge_input_logprobs(prefill: bytes, decode: bytes) -> bytes:
    """Put the prefill leg's prompt logprobs in front of the decode leg's (as sglang-router does):
    only the prefill server ran the prompt."""
    try:
        p, d = _decode(prefill), _decode(decode)
    except msgspec.DecodeError:
        return decode
    pairs = zip(p, d) if isinstance(p, list) and isinstance(d, list) else [(p, d)]
    for pi, di in pairs:
        pm, dm = pi.get("meta_info") if isinstance(pi, dict) else None, \
            di.get("meta_info") if isinstance(di, dict) else None
        if isinstance(pm, dict) and isinstance(dm, dict) and "input_token_logprobs" in pm:
            dm["input_token_logprobs"] = list(pm["input_token_logprobs"] or []) + \
                list(dm.get("input_token_logprobs") or [])
    return _encode(d)


def _has_error(payload: bytes) -> bool:
    """A 200 answer that carries an error (SGLang's servers put one in a JSON body or an SSE event)."""
    if b'"error"' not in payload:
        return False
    for part in payload.split(b"data: ") if payload.startswith(b"data: ") else [payload]:
        part = part.strip()
        if not part or part == b"[DONE]":
            continue
        try:
            obj = _decode(part)
        except msgspec.DecodeError:
            continue
        if isinstance(obj, dict) and obj.get("error"):
            return True
    return False


def _refuse_too_large(leg: str, ep: Endpoint, e: UpstreamError) -> None:
    """An answer over --max-response-bytes ends the request with a 502 naming the cap: any pair
    would answer as much, so it is not retried."""
    if e.cause == TOO_LARGE:
        raise upstream_failed(f"{leg} worker {ep.key}: {e}") from None


def _short(payload: bytes, n: int = 300) -> str:
    return payload[:n].decode("utf-8", "replace").strip()


def _passthrough_error(failure: LegFailure) -> web.Response:
    """A worker's client error (4xx), given to the client as the worker said it."""
    body = failure.body or b""
    try:
        obj = _decode(body)
        ok = isinstance(obj, dict) and isinstance(obj.get("error"), dict)
    except msgspec.DecodeError:
        ok = False
    if not ok:
        body = RouterError(failure.status, f"{failure.leg} worker: {_short(body)}",
                           "invalid_request_error").body()
    return web.Response(body=body, status=failure.status, content_type="application/json")
