"""Request migration: what the router needs to continue a ``/generate`` stream on another pair.

Pure logic over bytes and dicts; ``router/pd_proxy.py`` does the I/O. A decode leg
that fails after the first byte (connection lost, the server dying, an error event
of a server-side cause such as a drain timeout) is continued as a new request on
another prefill/decode pair: the prompt's token ids plus the token ids already
streamed become ``input_ids``, ``max_new_tokens`` shrinks by what was streamed,
and every other field (sampling settings, seed, ``ignore_eos``) is kept.

Why token ids, not text: a ``/generate`` event carries ``output_ids`` next to its
text, so the router knows exactly which tokens the client has. Continuing from
those ids runs the same forward pass over the same sequence as the uninterrupted
request (the prefill of the continuation computes the KV the dead decode had
computed step by step), so greedy output stays token-for-token equal. Continuing
from text would re-tokenize generated text, which need not give back the
generated ids (a BPE merge across the boundary changes the sequence).

The stream is relayed event by event (an event ends with a blank line), so a
failure never leaves half an event at the client, and the ids counted are those
of whole events the client has. After a migration each event of the
continuation is rewritten into the original request's terms: ``output_ids`` and
``text`` (when the server streams whole texts, its default) get what was sent
before in front, ``meta_info`` keeps the original ``id`` and ``prompt_tokens``,
counts ``completion_tokens`` over the whole answer, and carries
``pdserve_migrations`` (the response's headers left with the first byte).

What is migrated: single-prompt streamed ``/generate`` requests without
``return_logprob`` (the continuation's input logprobs would cover generated
tokens) or a grammar (the continuation would restart it). OpenAI streams are migrated
by ``router/migration/openai_migration.py``; JSON requests have had no byte yet, so they are
retried whole by the retry loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_DONE = b"[DONE]"
MIGRATABLE_PATHS = ("/generate",)
# an error event with one of these codes is the server's fault (dying, drained, overloaded):
# another server may finish the request; a 4xx would fail anywhere
_SERVER_SIDE = frozenset({408, 429, 500, 502, 503, 504})


def migratable(path: str, body: dict) -> bool:
    """Whether a request can be continued on another pair should its decode leg fail mid-stream."""
    if path not in MIGRATABLE_PATHS or not body.get("stream") or body.get("return_logprob"):
        return False
    if isinstance(body.get("text"), list) or isinstance(body.get("rid"), list):
        return False
    ids = body.get("input_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        return False
    sp = body.get("sampling_params")
    if sp is None:
        return True
    # a list of sampling params belongs to a batch; a continuation would restart a grammar
    return isinstance(sp, dict) and not any(sp.get(k) is not None for k in ("regex", "ebnf", "json_schema"))


class SSEEvents:
    """Split a byte stream into whole SSE events (each with its ``\\n\\n``)."""

    __slots__ = ("_buf",)

    def __init__(self):
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return []
        self._buf = buf[end + 2:]
        return [e + b"\n\n" for e in buf[:end].split(b"\n\n") if e.strip()]

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete (dropped if the stream fails)."""
        return self._buf


@dataclass(frozen=True, slots=True)
class Event:
    """One parsed event: ``done`` ([DONE]), an ``error`` (message, code) or an output ``obj``."""

    raw: bytes
    done: bool = False
    obj: dict | None = None
    error: tuple[str, int | None] | None = None

    @property
    def server_side_error(self) -> bool:
        return self.error is not None and self.error[1] in _SERVER_SIDE


def parse_event(raw: bytes) -> Event:
    """An SSE event of a /generate stream (``data: ...``); anything unparsable passes as is."""
    data = raw.strip()
    if data.startswith(b"data:"):
        data = data[5:].strip()
    if data == _DONE:
        return Event(raw, done=True)
    try:
        obj = _decode(data)
    except msgspec.DecodeError:
        return Event(raw)
    if not isinstance(obj, dict):
        return Event(raw)
    err = obj.get("error")
    if err:
        if isinstance(err, dict):
            code = err.get("code")
            return Event(raw, error=(str(err.get("message")), code if isinstance(code, int) else None))
        return Event(raw, error=(str(err), None))
    return Event(raw, obj=obj)


class Transcript:
    """What the client has of one request across its legs: token ids, text, the finish.

    A server streams either whole outputs so far (SGLang's default) or deltas
    (``--incremental-streaming-output``); ``deltas`` says which (None: not known yet).
    An event whose ``output_ids`` are not all its ``completion_tokens`` is a delta; one
    with all of them after earlier tokens is a whole output; the first token-bearing
    event is both, and reads the same either way."""

    def __init__(self, deltas: bool | None = None):
        self.deltas = deltas
        self.ids: list[int] = []  # every output id the client has
        self.text = ""  # every output character the client has
        self.finished = False  # an event with a finish_reason went out
        self.rid: str | None = None
        self.prompt_tokens: int | None = None  # of the original request
        self.migrations = 0
        self._base_ids = 0  # ids before this leg (this leg's output: ``ids[_base_ids:]``)
        self._base_text = 0

    def new_leg(self, deltas_hint: bool) -> None:
        """The next events come from a continuation: they count after everything so far.
        ``deltas_hint``: how the failed server streamed (its /server_info), used when its
        events did not tell (at most one of them carried tokens)."""
        if self.deltas is None:
            self.deltas = deltas_hint
        self.migrations += 1
        self._base_ids, self._base_text = len(self.ids), len(self.text)

    def _is_delta(self, ids: list, completion_tokens) -> bool:
        if self.deltas is None and isinstance(completion_tokens, int):
            if len(ids) != completion_tokens:
                self.deltas = True
            elif len(self.ids) > self._base_ids and ids:
                self.deltas = False
        return bool(self.deltas)

    def accept(self, ev: Event) -> bytes:
        """Take an output event of the current leg; returns the bytes to send the client."""
        obj = ev.obj
        if obj is None:
            return ev.raw
        ids = obj.get("output_ids")
        text = obj.get("text")
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
        if not isinstance(ids, list):
            ids = []
        if not isinstance(text, str):
            text = ""
        delta = self._is_delta(ids, meta.get("completion_tokens"))
        if delta:  # appended: no copy of the answer so far per event
            self.ids.extend(ids)
            self.text += text
        else:
            self.ids[self._base_ids:] = ids
            self.text = self.text[:self._base_text] + text
        if meta.get("finish_reason") is not None:
            self.finished = True
        if not self.migrations:
            if self.rid is None:
                self.rid = meta.get("id")
                self.prompt_tokens = meta.get("prompt_tokens")
            return ev.raw
        if not delta:
            obj["output_ids"], obj["text"] = list(self.ids), self.text
        if "completion_tokens" in meta:
            meta["completion_tokens"] = len(self.ids)
        if self.prompt_tokens is not None and "prompt_tokens" in meta:
            meta["prompt_tokens"] = self.prompt_tokens
        if self.rid is not None and "id" in meta:
            meta["id"] = self.rid
        meta["pdserve_migrations"] = self.migrations
        return b"data: " + _encode(obj) + b"\n\n"


    def tail(self) -> bytes:
        """Nothing is owed before [DONE] once the finished event went out (cf. OpenAITranscript)."""
        return b""


def error_event(message: str) -> bytes:
    """The SSE error event (and [DONE]) that ends a stream whose decode leg failed for good."""
    return b"data: " + _encode({"error": {"message": message, "type": "upstream_error", "param": None,
                                          "code": 502}}) + b"\n\n" + b"data: " + _DONE + b"\n\n"


def continuation_body(body: dict, prompt_ids: list[int], sent_ids: list[int]) -> dict:
    """The client's /generate body continued after ``sent_ids``: prompt plus sent ids as
    ``input_ids``, ``max_new_tokens`` (and ``min_new_tokens``) less what was sent, the rest kept
    (a request without ``max_new_tokens`` is clamped by the server to the context left, which the
    longer prompt shrinks by as much)."""
    out = {k: v for k, v in body.items() if k not in ("text", "input_ids", "rid")}
    out["input_ids"] = list(prompt_ids) + list(sent_ids)
    sp = dict(body.get("sampling_params") or {})
    n = len(sent_ids)
    if isinstance(sp.get("max_new_tokens"), int):
        sp["max_new_tokens"] = max(0, sp["max_new_tokens"] - n)
    if isinstance(sp.get("min_new_tokens"), int):
        sp["min_new_tokens"] = max(0, sp["min_new_tokens"] - n)
    out["sampling_params"] = sp
    return out


def tokens_left(body: dict, sent: int) -> int | None:
    """Tokens the request may still generate (None: bounded by the context only)."""
    sp = body.get("sampling_params")
    m = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    return max(0, m - sent) if isinstance(m, int) else None
