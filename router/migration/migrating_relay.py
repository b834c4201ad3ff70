"""The streamed answer of a migratable request: relayed event by event, continued on another
pair when its decode leg fails mid-stream (``--migration-limit``; the rules are
``router/migration/migration.py`` for /generate, ``router/migration/openai_migration.py`` for OpenAI streams).

One relay per client stream. It forwards whole SSE events and keeps the
``Transcript`` of what the client has. When the decode leg fails (connection lost
or timed out, the stream closed before its end, an error event of a server-side
cause) and migrations are left, it chooses a new pair that avoids every decode
server that failed this request, sends the continuation's two legs as a request
does, and relays the new decode leg in the original request's terms. A failure it
cannot migrate (limit reached, no other healthy decode server, the new legs
failing as often as the limit allows) ends the stream with the error event of a
router without migration.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from pdserve.router.errors import RouterError
from pdserve.router.leg_failure import LegFailure
from pdserve.router.migration.migration import (SSEEvents, Transcript, continuation_body, error_event, parse_event,
                                      tokens_left)
from pdserve.router.migration.openai_migration import (CHAT, COMPLETIONS, OPENAI_PATHS, OpenAITranscript,
                                             openai_continuation, openai_tokens_left)
from pdserve.router.workers.pairing import Pair, Pairing
from pdserve.router.upstream import UpstreamError, UpstreamResponse, drain_response

log = logging.getLogger("pdserve.router")

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_DONE = b"data: [DONE]\n\n"
MIGRATIONS_HEADER = "x-pdserve-migration-limit"


class LegDied(Exception):
    """The decode leg being relayed failed mid-stream: ``cause`` for /metrics, ``message`` for logs."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause, self.message = cause, message


class MigratingRelay:
    def __init__(self, proxy, request: web.Request, pair: Pair, path: str, body: dict, t0: float):
        """``proxy``: the PDProxy whose legs, pairing, metrics and background set this relay uses."""
        self.proxy = proxy
        self.request = request
        self.pair = pair
        self.path = path
        self.body = body
        self.t0 = t0
        self.openai = path in OPENAI_PATHS
        if self.openai:
            opts = body.get("stream_options")
            self.transcript = OpenAITranscript(path == CHAT, bool(body.get("return_token_ids")),
                                               isinstance(opts, dict) and bool(opts.get("include_usage")))
            prompt = body.get("prompt")
            self._prompt_ids = prompt if isinstance(prompt, list) else None
        else:
            self.transcript = Transcript()
            self._prompt_ids = body.get("input_ids")
        self._open: list[UpstreamResponse] = []  # continuation legs' answers, closed at the end
        self._first = True  # no byte has reached the client yet (TTFT is observed once)

    async def run(self, resp: UpstreamResponse, chunk: bytes, headers: dict[str, str]
                  ) -> tuple[web.StreamResponse, bool]:
        """Relay from the first decode leg's ``resp`` (its first ``chunk`` read); returns the client's
        response and whether the first leg's end is being drained in the background."""
        limit = self.proxy.config.migration_limit
        out = web.StreamResponse(status=resp.status, headers={
            "Content-Type": resp.content_type or "text/event-stream", "Cache-Control": "no-cache",
            MIGRATIONS_HEADER: str(limit), **headers})
        await out.prepare(self.request)
        exclude: set[str] = set()
        d_ep, first_resp = self.pair.decode, resp
        try:
            while True:
                try:
                    draining = await self._relay_leg(out, resp, chunk)
                    if draining and resp is not first_resp:
                        self._open.remove(resp)  # the background drain closes it
                    return out, draining and resp is first_resp
                except LegDied as died:
                    resp.close()  # drops what is left of the dead leg
                    self.proxy.metrics.leg_errors.inc(d_ep.worker.url, "decode")
                    msg = f"decode worker {d_ep.key} failed mid-stream: {died.message}"
                    log.warning(msg)
                    exclude.add(d_ep.key)
                    nxt = await self._migrate(died.cause, exclude, d_ep.worker.stream_deltas)
                    if nxt is None:
                        await self._end_with_error(out, msg)
                        return out, False
                    if nxt is True:  # every token was sent: the request is complete
                        await out.write_eof(self.transcript.tail() + _DONE)
                        return out, False
                    if d_ep is not self.pair.decode:
                        d_ep.end(self.pair.decode_tokens)
                    d_ep, resp, chunk = nxt
                    d_ep.begin(self.pair.decode_tokens)  # the proxy counts the first leg's decode endpoint
        finally:
            if d_ep is not self.pair.decode:
                d_ep.end(self.pair.decode_tokens)
            for r in self._open:
                r.close()  # no-op when read to its end; otherwise aborts (the server aborts the room)

    async def _relay_leg(self, out: web.StreamResponse, resp: UpstreamResponse, chunk: bytes) -> bool:
        """Relay one decode leg to its end; returns whether its end is drained in the background
        ([DONE] seen before the upstream's EOF). Raises LegDied."""
        events = SSEEvents()
        tr = self.transcript
        try:
            while True:
                sends = []
                done = False
                for raw in events.feed(chunk):
                    ev = parse_event(raw)
                    if ev.done:
                        done = True
                        break
                    if ev.server_side_error:
                        raise LegDied("error_event", ev.error[0])
                    sends.append(tr.accept(ev))
                if done:
                    await out.write_eof(b"".join(sends) + _DONE)
                    self._note_first()
                    if resp.at_eof():
                        return False
                    self.proxy.keep(asyncio.ensure_future(drain_response(resp)))
                    return True
                if sends:
                    await out.write(b"".join(sends))
                    self._note_first()
                chunk = b"" if resp.at_eof() else await resp.readany()
                if not chunk:
                    if tr.finished:  # whole answer sent, only [DONE] (and an OpenAI usage) missing
                        await out.write_eof(tr.tail() + _DONE)
                        return False
                    raise LegDied("eof", "closed the stream before its end")
        except UpstreamError as e:
            raise LegDied(e.cause, str(e)) from None

    def _note_first(self) -> None:
        if self._first:
            self._first = False
            self.proxy.metrics.ttft.observe(time.perf_counter() - self.t0)

    async def _migrate(self, cause: str, exclude: set[str], deltas_hint: bool):
        """Open the next decode leg of the request: (endpoint, response, first chunk); True when
        nothing is left to generate; None when it cannot be migrated."""
        proxy, tr = self.proxy, self.transcript
        limit = proxy.config.migration_limit
        if self.openai:
            left = openai_tokens_left(self.body, len(tr.ids), len(tr.prompt_ids or ()),
                                      self.pair.decode.worker.token_room)
        else:
            left = tokens_left(self.body, len(tr.ids))
        if tr.finished or left == 0:
            return True
        if self.openai and (tr.ids_missing or (self.path == CHAT and (tr.prompt_ids is None or left is None))):
            # a server that sent no token ids; a chat that died before its first chunk (no template
            # applied here), or without a budget and its first decode server did not say its room
            proxy.metrics.migrations.inc(cause, "failed")
            return None
        while True:
            if tr.migrations >= limit:
                proxy.metrics.migrations.inc(cause, "limit")
                return None
            try:
                pair = proxy.pairing.choose(self.body, exclude)
            except RouterError:
                pair = None
            if pair is None or pair.decode.key in exclude:
                proxy.metrics.migrations.inc(cause, "no_pair")
                return None
            tr.new_leg(deltas_hint)
            try:
                resp, chunk = await self._open_legs(pair)
            except _LegsFailed as failed:
                log.info("migration %d of a stream failed: %s", tr.migrations, failed)
                proxy.metrics.migrations.inc(cause, "failed")
                if failed.endpoint_key:
                    exclude.add(failed.endpoint_key)
                continue
            proxy.metrics.migrations.inc(cause, "migrated")
            log.info("stream migrated to prefill %s, decode %s after %d tokens (%s)",
                     pair.prefill.key, pair.decode.key, len(tr.ids), cause)
            return pair.decode, resp, chunk

    async def _open_legs(self, pair: Pair) -> tuple[UpstreamResponse, bytes]:
        """Send the continuation's two legs; wait for the decode leg's first bytes."""
        proxy = self.proxy
        try:
            prompt = await self._prompt(pair)
        except LegFailure as f:
            raise _LegsFailed(f.describe(), f.endpoint.key) from None
        if self.openai:  # token ids in, so a completion whatever the client's endpoint was
            rooms = [w.token_room for w in (self.pair.decode.worker, pair.prefill.worker, pair.decode.worker)]
            room = None if None in rooms else min(rooms)
            path, body = COMPLETIONS, openai_continuation(self.body, prompt, self.transcript.ids, room)
        else:
            path, body = self.path, continuation_body(self.body, prompt, self.transcript.ids)
        p_body, d_body = Pairing.leg_bodies(body, pair)
        p_task = asyncio.ensure_future(proxy.leg("prefill", pair.prefill, path, p_body, self.pair.prefill_tokens))
        d_task = asyncio.ensure_future(proxy.open_stream(pair.decode, path, d_body))
        try:
            resp, chunk = await proxy.first_bytes(p_task, d_task)
        except BaseException as e:
            for t in (p_task, d_task):
                if not t.done():
                    t.cancel()
                t.add_done_callback(_consume)
            if isinstance(e, LegFailure):
                raise _LegsFailed(e.describe(), e.endpoint.key) from None
            raise
        p_task.add_done_callback(_consume)
        self._open.append(resp)
        if not p_task.done():  # the prefill leg answers once its KV left: let it finish
            proxy.keep(p_task)
        return resp, chunk

    async def _prompt(self, pair: Pair) -> list[int]:
        """The prompt's token ids: the client's ``input_ids`` (OpenAI: as the first decode server
        gave them, chat template applied, or the completion's token-id prompt), else its text as the
        prefill server tokenizes it (``/tokenize``, the tokenizer /generate uses, special tokens added)."""
        if self.openai and self.transcript.prompt_ids is not None:
            return self.transcript.prompt_ids
        if self._prompt_ids is None:
            if self.path == CHAT:  # the leg died before its first chunk: no template to apply here
                raise LegFailure("decode", pair.decode, "no prompt token ids from the failed leg", 500,
                                 cause="malformed")
            text = self.body.get("prompt") if self.openai else self.body.get("text")
            _, _, payload = await self.proxy.leg(
                "prefill", pair.prefill, "/tokenize", _encode({"prompt": text or ""}))
            try:
                tokens = _decode(payload)["tokens"]
            except (msgspec.DecodeError, KeyError, TypeError):
                raise LegFailure("prefill", pair.prefill, "/tokenize gave no tokens", 500,
                                 cause="malformed") from None
            self._prompt_ids = list(tokens)
        return self._prompt_ids

    async def _end_with_error(self, out: web.StreamResponse, msg: str) -> None:
        await out.write_eof(error_event(msg))


class _LegsFailed(Exception):
    def __init__(self, message: str, endpoint_key: str | None):
        super().__init__(message)
        self.endpoint_key = endpoint_key


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
