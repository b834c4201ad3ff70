"""Which grammar a request asks for, checked at the front end before anything is scheduled.

A request names at most one of SGLang's three grammar parameters. ``check_grammar``
parses it with xgrammar (no tokenizer needed: a parse error is the client's), so an
invalid schema, regex or grammar is an HTTP 400 naming the field, never a failure
inside a scheduler rank.
"""

from __future__ import annotations

import json
from typing import Any

# SGLang's sampling-parameter names, in the order a request is checked
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")

# OpenAI's ``response_format: {"type": "json_object"}``: any JSON object
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class InvalidGrammar(ValueError):
    """A grammar parameter that does not parse; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} is invalid: {message}")
        self.field = field


def schema_text(field: str, value: Any) -> str:
    """A JSON schema as text: SGLang sends a string, OpenAI an object."""
    if isinstance(value, dict) or isinstance(value, bool):
        return json.dumps(value)
    if not isinstance(value, str):
        raise InvalidGrammar(field, "a JSON schema must be an object or a string holding one")
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise InvalidGrammar(field, f"not JSON: {exc}") from None
    if not isinstance(parsed, (dict, bool)):
        raise InvalidGrammar(field, "a JSON schema must be an object")
    return value


def xgrammar_message(exc: Exception) -> str:
    """xgrammar's error text without its C++ "[time] file:line:" prefix, which helps nobody."""
    return str(exc).split(": ", 1)[-1].strip()


def check_grammar(kind: str, text: str, field: str | None = None) -> None:
    """Parse ``text`` as a grammar of ``kind`` (one of ``GRAMMAR_FIELDS``); raise InvalidGrammar
    naming ``field`` (default: ``kind``) when it does not parse."""
    import xgrammar as xgr  # imported on first use: ~2 s that servers without grammars skip

    build = {"json_schema": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
             "ebnf": xgr.Grammar.from_ebnf}[kind]
    if not isinstance(text, str) or not text:
        raise InvalidGrammar(field or kind, "must be a non-empty string")
    try:
        build(text)
    except (RuntimeError, ValueError) as exc:
        raise InvalidGrammar(field or kind, xgrammar_message(exc)) from None
