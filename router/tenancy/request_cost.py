"""What a request costs in tokens, read from its body before it is queued: the prompt's tokens
(``input_ids`` counted; text estimated at 4 characters a token, as the router has no tokenizer
for every policy) and the tokens it may generate (``max_tokens``, ``max_completion_tokens`` or
``sampling_params.max_new_tokens``; the engines' default of 128 without one)."""

from __future__ import annotations

from dataclasses import dataclass

CHARS_PER_TOKEN = 4
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class RequestCost:
    prompt_tokens: int
    max_new_tokens: int

    @property
    def tokens(self) -> int:
        """The fair-share and tokens-per-second cost: prompt and generation together."""
        return self.prompt_tokens + self.max_new_tokens


def _text_tokens(value: object) -> int:
    if isinstance(value, str):
        return max(1, -(-len(value) // CHARS_PER_TOKEN))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)
        return sum(_text_tokens(v) for v in value)
    if isinstance(value, dict):  # a chat message or a content part
        return sum(_text_tokens(value.get(k)) for k in ("content", "text") if k in value)
    return 0


def request_cost(body: dict) -> RequestCost:
    if "input_ids" in body:
        prompt = _text_tokens(body["input_ids"])
    elif "messages" in body:
        prompt = _text_tokens(body["messages"])
    else:
        prompt = _text_tokens(body.get("prompt", body.get("text")))
    sp = body.get("sampling_params")
    limit = (body.get("max_completion_tokens") or body.get("max_tokens")
             or (sp.get("max_new_tokens") if isinstance(sp, dict) else None))
    gen = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else DEFAULT_MAX_NEW_TOKENS
    return RequestCost(max(1, prompt), gen)
