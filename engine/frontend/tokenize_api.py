"""``POST /tokenize`` and ``POST /detokenize`` (also under ``/v1/``), with SGLang's bodies.

``/tokenize``:   ``{"model"?, "prompt": str | [str], "add_special_tokens"?: true}``
                 -> ``{"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}``
``/detokenize``: ``{"model"?, "tokens": [int] | [[int]]}`` -> ``{"text": str | [str]}``

A list in gives a list out. Special tokens are kept in the text, so that
detokenizing what ``/tokenize`` gave returns the prompt.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.engine.frontend.request_error import RequestError


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str | list[str]
    model: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int | list[int]]  # msgspec has no union of two list types: checked in detokenize
    model: str | None = None


def check_tokenize(req: TokenizeRequest, max_chars: int, max_prompts: int) -> None:
    """Before tokenizing: at most ``max_prompts`` prompts of at most ``max_chars`` characters each."""
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if len(prompts) > max_prompts:
        raise RequestError(f"prompt holds {len(prompts)} prompts; at most {max_prompts} are allowed", param="prompt")
    longest = max(map(len, prompts), default=0)
    if longest > max_chars:
        raise RequestError(f"prompt has {longest} characters; at most {max_chars} are allowed", param="prompt",
                           code="context_length_exceeded")


def tokenize(tokenizer, req: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    ids = [tokenizer.encode(p, add_special_tokens=req.add_special_tokens) for p in prompts]
    if isinstance(req.prompt, str):
        return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": max_model_len}
    return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": max_model_len}


def detokenize(tokenizer, req: DetokenizeRequest, vocab_size: int) -> dict[str, Any]:
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    if any(isinstance(t, list) != batch for t in req.tokens):
        raise RequestError("tokens must be a list of token ids or a list of such lists", param="tokens")
    seqs = req.tokens if batch else [req.tokens]
    for seq in seqs:
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"tokens has token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                               param="tokens")
    texts = [tokenizer.decode(seq, skip_special_tokens=False) for seq in seqs]
    return {"text": texts if batch else texts[0]}
