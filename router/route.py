"""One routing decision as data: what the router knows of a request, and where it goes.

The proxy reads a request once into a ``RouteQuery`` (the prompt's text where a policy reads
text, its token ids where a tokenizer is loaded: tokenized once, whichever policy or the
router's own tokenizer has one) and asks for a ``Route`` once: the decode endpoint, the prefill
endpoint or none (the decode worker prefills it itself), and the token counts the choice was
made on. Pure data; ``prompt_ids`` is the one function here that needs a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.router.local_prefill import LocalReason

#: (uncached tokens on the decode endpoint, the whole prompt's tokens) -> why it goes local, or
#: None for the prefill/decode path; either count may be None (unknown)
LocalRule = Callable[[int | None, int | None], LocalReason | None]


@dataclass(slots=True, frozen=True)
class RouteQuery:
    """A request as the policies see it, read once."""

    body: dict
    text: str | None = None  # the prompt as text, when a policy reads text (cache-aware trees)
    ids: list[int] | None = None  # its token ids: None for a batch, or with no tokenizer loaded
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it names (router/workers/adapters.py)
    lora_id: int = 0  # the prefix-cache namespace of its one adapter (0: the base model's, or several)

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.ids is None else len(self.ids)


@dataclass(slots=True)
class Route:
    """Where one request goes. ``prefill`` None with a ``local_reason``: the decode endpoint
    prefills it itself; ``room`` is set by the pairing for the prefill/decode path."""

    decode: Any  # worker_registry.Endpoint
    prefill: Any = None
    prompt_tokens: int | None = None
    uncached_tokens: int | None = None  # the prompt less what the decode endpoint holds, if asked
    local_reason: LocalReason | None = None
    room: int | list[int] | None = None

    @property
    def local(self) -> bool:
        return self.local_reason is not None


def prompt_ids(tokenizer, body: dict) -> list[int] | None:
    """The prompt's token ids as the worker computes them; None for a batch, an unknown shape, or
    text without a ``tokenizer`` (None: not loaded; a prompt of token ids needs none)."""
    from pdserve.engine.text.prompt import ChatPrompt, encode_prompt

    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return ids
    if tokenizer is None:
        return None
    for name in ("text", "prompt"):
        value = body.get(name)
        if isinstance(value, str):
            return encode_prompt(tokenizer, value)
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return value
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    rendered = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # text parts are joined, as the server does
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        d = {"role": "system" if m.get("role") == "developer" else m.get("role"), "content": content or ""}
        if m.get("name") is not None:
            d["name"] = m["name"]
        rendered.append(d)
    prompt = ChatPrompt(rendered, bool(body.get("continue_final_message")),
                        dict(body.get("chat_template_kwargs") or {}))
    return encode_prompt(tokenizer, prompt)
