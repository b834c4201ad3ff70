"""Streaming HTTP clients of the three APIs, timing every token at the client.

A backend knows its endpoint, how to ask for exactly ``output_len`` tokens
(greedy, EOS ignored) and how to read its stream events. ``send_request``
does the HTTP and the timing, the same for all.

- ``generate``: pdserve/SGLang ``POST /generate``; each SSE event carries the
  text and ids so far and ``meta_info.completion_tokens``, so tokens that
  arrive together in one event are counted exactly.
- ``completions``: OpenAI ``POST /v1/completions``; one token per non-empty
  chunk, the count from the final usage chunk (``include_usage``).
- ``chat``: OpenAI ``POST /v1/chat/completions``; as completions, content
  deltas; the opening role-only chunk is not a token.
"""

from __future__ import annotations

import abc
import asyncio
import json
import time

import aiohttp

from .datasets import DatasetRow
from .metrics import RequestOutput


class StreamError(Exception):
    """The server reported an error inside the stream, or the stream was malformed."""


class StreamParser(abc.ABC):
    """Reads one response's events; counts tokens and keeps the server's usage figures."""

    def __init__(self):
        self.text = ""
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.token_events = 0

    def feed(self, obj: dict) -> int:
        """Take one decoded event; return how many new output tokens it carried (0: none)."""
        if not isinstance(obj, dict):
            raise StreamError(f"unexpected stream event: {str(obj)[:200]}")
        if "error" in obj:
            err = obj["error"]
            raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        n = self._feed(obj)
        if n:
            self.token_events += 1
        return n

    @abc.abstractmethod
    def _feed(self, obj: dict) -> int: ...


class _GenerateParser(StreamParser):
    def _feed(self, obj: dict) -> int:
        meta = obj.get("meta_info") or {}
        before = self.completion_tokens or 0
        if isinstance(meta.get("completion_tokens"), int):
            self.completion_tokens = meta["completion_tokens"]
        elif isinstance(obj.get("output_ids"), list):
            self.completion_tokens = len(obj["output_ids"])
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        if isinstance(obj.get("text"), str):
            self.text = obj["text"]  # the whole text so far, not a delta
        return max(0, (self.completion_tokens or 0) - before)


class _OpenAIParser(StreamParser):
    def _feed(self, obj: dict) -> int:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        choices = obj.get("choices") or []
        piece = self._piece(choices[0]) if choices else ""
        if piece:
            self.text += piece
            return 1
        return 0

    @staticmethod
    @abc.abstractmethod
    def _piece(choice: dict) -> str: ...


class _CompletionsParser(_OpenAIParser):
    @staticmethod
    def _piece(choice: dict) -> str:
        return choice.get("text") or ""


class _ChatParser(_OpenAIParser):
    @staticmethod
    def _piece(choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""


class Backend(abc.ABC):
    """One streaming API."""

    path: str
    openai: bool = False

    @abc.abstractmethod
    def body(self, row: DatasetRow, output_len: int, model: str | None) -> dict:
        """The JSON body asking for exactly ``output_len`` greedy tokens, streamed."""

    @abc.abstractmethod
    def parser(self) -> StreamParser:
        """A fresh parser for one response."""


class GenerateBackend(Backend):
    path = "/generate"

    def body(self, row, output_len, model):
        prompt = {"input_ids": list(row.prompt_ids)} if row.prompt_ids is not None else {"text": row.prompt}
        sp = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
        return {**prompt, "sampling_params": sp, "stream": True}

    def parser(self):
        return _GenerateParser()


def _openai_common(output_len: int, model: str | None) -> dict:
    body = {
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    return body


class CompletionsBackend(Backend):
    path = "/v1/completions"
    openai = True

    def body(self, row, output_len, model):
        prompt = list(row.prompt_ids) if row.prompt_ids is not None else row.prompt
        return {"prompt": prompt, **_openai_common(output_len, model)}

    def parser(self):
        return _CompletionsParser()


class ChatBackend(Backend):
    path = "/v1/chat/completions"
    openai = True

    def body(self, row, output_len, model):
        if row.system is not None:
            messages = [{"role": "system", "content": row.system}, {"role": "user", "content": row.question or ""}]
        else:
            messages = [{"role": "user", "content": row.prompt}]
        return {"messages": messages, **_openai_common(output_len, model)}

    def parser(self):
        return _ChatParser()


BACKENDS: dict[str, type[Backend]] = {
    "generate": GenerateBackend,
    "completions": CompletionsBackend,
    "chat": ChatBackend,
}

DONE = object()


async def iter_sse(resp: aiohttp.ClientResponse):
    """Yield ``(arrival_time, event)`` for each ``data:`` line; ``event`` is the decoded
    JSON or DONE. The time is when the bytes holding the line arrived."""
    buf = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            line = buf[start:nl].strip()
            start = nl + 1
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                yield now, DONE
                return
            try:
                yield now, json.loads(payload)
            except json.JSONDecodeError as exc:
                raise StreamError(f"bad JSON in stream: {payload[:200]!r}") from exc
        buf = buf[start:]


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    backend: Backend,
    row: DatasetRow,
    model: str | None,
    bench_start: float,
    output_len: int | None = None,
    headers: dict | None = None,
    extra_body: dict | None = None,
) -> RequestOutput:
    """Send one streamed request and time it; failures come back as ``success=False``.
    ``extra_body``: fields added to the backend's body (a request's ``priority``)."""
    output_len = row.output_len if output_len is None else output_len
    out = RequestOutput(prompt_len=row.prompt_len, expected_output_len=output_len)
    parser = backend.parser()
    st = time.perf_counter()
    out.start_time = st - bench_start
    try:
        body = backend.body(row, output_len, model)
        if extra_body:
            body.update(extra_body)
        async with session.post(base_url + backend.path, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                out.error = f"HTTP {resp.status}: {text.strip()[:500]}"
                out.latency = time.perf_counter() - st
                return out
            last = None
            done = False
            async for ts, obj in iter_sse(resp):
                if obj is DONE:
                    done = True
                    break
                n = parser.feed(obj)
                if n == 0:
                    continue
                if last is None:
                    out.ttft = ts - st
                else:
                    # tokens that came together share the gap since the previous arrival
                    out.itl.extend([(ts - last) / n] * n)
                last = ts
        out.latency = time.perf_counter() - st
        if not done:
            raise StreamError("stream ended without data: [DONE]")
        if last is None:
            raise StreamError("no output token received")
        out.output_len = parser.completion_tokens if parser.completion_tokens is not None else parser.token_events
        if parser.prompt_tokens is not None:
            out.prompt_len = parser.prompt_tokens
        out.generated_text = parser.text
        out.success = True
    except StreamError as exc:
        out.error = str(exc)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not out.success and not out.latency:
        out.latency = time.perf_counter() - st
    return out
