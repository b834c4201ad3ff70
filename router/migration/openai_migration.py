"""Request migration of OpenAI streams (``/v1/completions``, ``/v1/chat/completions``): the rules.

Pure logic over dicts and bytes; ``router/migration/migrating_relay.py`` does the I/O, and
``router/migration/migration.py`` holds the ``/generate`` counterpart. An OpenAI chunk carries
text only, so the router asks the decode leg for the token ids as well
(``return_token_ids``, vLLM's field: each chunk's choice carries its new
``token_ids``, the first chunk the prompt's ``prompt_token_ids``) and strips them
again unless the client asked for them too. The ids make the continuation exact:
it is a ``/v1/completions`` request whose ``prompt`` is the prompt's token ids (as
the failed decode server tokenized them, chat template included) plus the ids the
client has, with ``max_tokens`` (and ``min_tokens``) less what was sent and every
sampling field kept. Its chunks are rewritten into the original response's terms:
the original ``id``, ``created``, ``model`` and ``object``; a chat chunk's
``delta.content`` from the completion's ``text``; ``usage`` counting the original
prompt and the whole answer once; and ``pdserve_migrations``, the number of moves,
on every chunk after the first move (the headers left with the first byte).

What is migrated: single-choice streams (``n`` 1) of one prompt without logprobs,
``echo``, ``suffix``, tools, a ``response_format`` other than text, or a grammar
(a continuation would restart the grammar). A chat request without
``max_tokens`` or ``max_completion_tokens`` was clamped by its decode server to
the room its prompt left (``min(max_context_len, max_total_num_tokens)`` of that
server's ``/server_info``, the worker's ``token_room``); its continuation gets
what is left of that room, capped by the new servers' rooms.
"""

from __future__ import annotations

import msgspec

from pdserve.router.migration.migration import Event

_encode = msgspec.json.encode
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OPENAI_PATHS = (CHAT, COMPLETIONS)
# the fields of a chat or completions body that mean the same in the continuation's /v1/completions
_KEPT = ("model", "frequency_penalty", "logit_bias", "presence_penalty", "seed", "stop", "stream_options",
         "temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
         "no_stop_trim", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "priority",
         "lora_path", "custom_logit_processor", "custom_params", "extra_key")
_GRAMMARS = ("regex", "ebnf", "json_schema")


def max_tokens(body: dict) -> int | None:
    """The answer's token budget the client gave (chat: ``max_completion_tokens`` first)."""
    m = body.get("max_completion_tokens")
    if m is None:
        m = body.get("max_tokens")
    return m if isinstance(m, int) and not isinstance(m, bool) else None


def openai_migratable(path: str, body: dict) -> bool:
    """Whether an OpenAI request can be continued on another pair should its decode leg fail mid-stream."""
    if path not in OPENAI_PATHS or body.get("stream") is not True:
        return False
    if body.get("n") not in (None, 1) or isinstance(body.get("rid"), list) or body.get("return_hidden_states"):
        return False
    if any(body.get(k) is not None for k in _GRAMMARS):
        return False
    if path == COMPLETIONS:
        p = body.get("prompt")
        one = isinstance(p, str) or (isinstance(p, list) and bool(p) and all(type(t) is int for t in p))
        return one and body.get("logprobs") is None and not body.get("echo") and body.get("suffix") is None \
            and body.get("best_of") in (None, 1)
    rf = body.get("response_format")
    return not body.get("logprobs") and not body.get("tools") and not body.get("functions") \
        and (rf is None or (isinstance(rf, dict) and rf.get("type") == "text"))


def with_token_ids(body: dict) -> dict:
    """The body the legs get: the client's, asking for the token ids."""
    return body if body.get("return_token_ids") else {**body, "return_token_ids": True}


def openai_tokens_left(body: dict, sent: int, prompt_len: int = 0, room: int | None = None) -> int | None:
    """Tokens the answer may still have after ``sent``: of the client's budget, else (a chat without
    one) of ``room``, the tokens prompt + answer may hold (None: not known)."""
    m = max_tokens(body)
    if m is None and "prompt" in body:
        m = 16  # OpenAI's default for completions
    if m is None and room is not None:
        m = room - prompt_len
    return max(0, m - sent) if m is not None else None


def openai_continuation(body: dict, prompt_ids: list[int], sent_ids: list[int], room: int | None = None) -> dict:
    """The ``/v1/completions`` body that continues ``body`` after ``sent_ids``; ``room``: what prompt +
    answer may hold on every server involved (the first decode server's, which clamped a chat without
    a budget, and the new pair's), used when the client gave no budget."""
    out = {k: body[k] for k in _KEPT if k in body}
    out.update(prompt=list(prompt_ids) + list(sent_ids), stream=True, return_token_ids=True)
    left = openai_tokens_left(body, len(sent_ids), len(prompt_ids), room)
    if left is not None:
        if room is not None and max_tokens(body) is None and "prompt" not in body:
            left = min(left, room - len(prompt_ids) - len(sent_ids))  # the new pair's room may be less
        out["max_tokens"] = left
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - len(sent_ids))
    return out


class OpenAITranscript:
    """What the client has of one OpenAI stream across its legs: the token ids, the finish, the usage.

    ``accept`` takes each event of the current leg and returns the bytes for the
    client (b"" for a chunk that only carried ids the client did not ask for)."""

    def __init__(self, chat: bool, client_wants_ids: bool, include_usage: bool):
        self.chat = chat
        self.keep_ids = client_wants_ids
        self.include_usage = include_usage
        self.ids: list[int] = []
        self.prompt_ids: list[int] | None = None  # as the first decode server tokenized the prompt
        self.finished = False  # a chunk with a finish_reason went out
        self.usage_sent = False
        # a chunk with output but no token_ids went out (a server without return_token_ids, such
        # as SGLang's): the ids the client has are not known, so the stream cannot be continued
        self.ids_missing = False
        self.migrations = 0
        self._head: dict | None = None  # the original response's id, created, model, object

    def new_leg(self, deltas_hint: bool = True) -> None:
        """The next events come from a continuation (OpenAI chunks are always deltas)."""
        self.migrations += 1

    def accept(self, ev: Event) -> bytes:
        obj = ev.obj
        if obj is None:
            return ev.raw
        if self._head is None:
            self._head = {k: obj.get(k) for k in ("id", "object", "created", "model")}
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if self.prompt_ids is None:
            p = obj.get("prompt_token_ids") if self.chat else (choice or {}).get("prompt_token_ids")
            if isinstance(p, list):
                self.prompt_ids = p
        ids = choice.get("token_ids") if choice is not None else None
        if isinstance(ids, list):
            self.ids.extend(ids)
        elif choice is not None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
            self.ids_missing = True
        if choice is not None and choice.get("finish_reason") is not None:
            self.finished = True
        if obj.get("usage") is not None:
            self.usage_sent = True
            if self.migrations:
                obj["usage"] = self.usage()
        if self.migrations:
            obj = self._in_original_terms(obj, choice)
            choice = obj["choices"][0] if obj["choices"] else None
        elif self.keep_ids:
            return ev.raw
        if not self.keep_ids:
            obj.pop("prompt_token_ids", None)
            if choice is not None:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
                if self._empty(choice):
                    return b""
        return b"data: " + _encode(obj) + b"\n\n"

    def _empty(self, choice: dict) -> bool:
        """A chunk the server sends only for its ids (held-back text): the client never sees it."""
        if choice.get("finish_reason") is not None or choice.get("logprobs"):
            return False
        if self.chat:
            delta = choice.get("delta") or {}
            return set(delta) <= {"content"} and not delta.get("content")
        return not choice.get("text")

    def _in_original_terms(self, obj: dict, choice: dict | None) -> dict:
        """A continuation's ``text_completion`` chunk as the original stream's chunk."""
        out = dict(self._head or {})
        if choice is None:
            out["choices"] = obj.get("choices") or []
        elif self.chat:
            text, finish = choice.get("text") or "", choice.get("finish_reason")
            c = {"index": 0, "delta": {"content": text} if text or finish is None else {},
                 "logprobs": None, "finish_reason": finish}
            if finish is not None:
                c["matched_stop"] = choice.get("matched_stop")
            if "token_ids" in choice:
                c["token_ids"] = choice["token_ids"]
            out["choices"] = [c]
        else:
            out["choices"] = [{**choice, "index": 0}]
        if obj.get("usage") is not None:
            out["usage"] = obj["usage"]
        out["pdserve_migrations"] = self.migrations
        return out

    def usage(self) -> dict:
        p, c = len(self.prompt_ids or ()), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def tail(self) -> bytes:
        """What the client still needs before [DONE] when a leg ended after the finish without
        its usage chunk."""
        if not (self.include_usage and self.finished and not self.usage_sent):
            return b""
        self.usage_sent = True
        obj = {**(self._head or {}), "choices": [], "usage": self.usage()}
        if self.migrations:
            obj["pdserve_migrations"] = self.migrations
        return b"data: " + _encode(obj) + b"\n\n"
