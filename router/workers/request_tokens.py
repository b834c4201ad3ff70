"""The tokens one request puts on its endpoints, as the router estimates them before sending it.

A prefill leg holds its prompt; a decode leg its prompt plus the most it may generate (the KV it
grows to). The prompt's length is exact where the request was tokenized (a policy's or the
router's tokenizer) or came as token ids, else about 4 characters a token; the output is the
request's ``max_new_tokens`` / ``max_tokens`` / ``max_completion_tokens``, else SGLang's default
of 128, times its ``n`` samples. The DP-rank rule compares ranks by these counts
(``dp_rank_choice.py``), so an estimate that is off by the same factor everywhere still ranks them
right. Pure logic.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default max_new_tokens
CHARS_PER_TOKEN = 4  # a text prompt's length without a tokenizer


class RequestTokens(NamedTuple):
    prefill: int  # the prompt(s)
    decode: int  # the prompt(s) plus the most they may generate


def request_tokens(body: dict, prompt_tokens: int | None = None) -> RequestTokens:
    """The estimate for ``body``; ``prompt_tokens``: its prompt's length where it was tokenized."""
    prompt = prompt_tokens if prompt_tokens is not None else _prompt_estimate(body)
    samples = _samples(body)
    output = _max_output(body) * samples * max(1, _num_prompts(body))
    return RequestTokens(prompt, prompt + output)


def _prompt_estimate(body: dict) -> int:
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids:
        return sum(len(x) for x in ids if isinstance(x, list)) if isinstance(ids[0], list) else len(ids)
    chars = 0
    for name in ("text", "prompt"):
        value = body.get(name)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            if value and all(isinstance(t, int) for t in value):
                return len(value)
            chars += sum(len(v) if isinstance(v, str) else len(v) * CHARS_PER_TOKEN
                         for v in value if isinstance(v, (str, list)))
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return -(-chars // CHARS_PER_TOKEN)


def _max_output(body: dict) -> int:
    sp = body.get("sampling_params")
    for source, name in ((sp, "max_new_tokens"), (body, "max_tokens"), (body, "max_completion_tokens"),
                         (body, "max_new_tokens")):
        value = source.get(name) if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return DEFAULT_MAX_NEW_TOKENS


def _samples(body: dict) -> int:
    sp = body.get("sampling_params")
    for value in (body.get("n"), sp.get("n") if isinstance(sp, dict) else None):
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return 1


def _num_prompts(body: dict) -> int:
    for name in ("text", "input_ids", "prompt"):
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return len(value)
    return 1
