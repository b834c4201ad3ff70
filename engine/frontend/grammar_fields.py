"""The grammar and tool fields of a request: SGLang's grammar fields, OpenAI's ``response_format``
and ``tools``, each parsed when the request arrives so that a bad one is a 400 naming its field
before anything is scheduled."""

from __future__ import annotations

import re
from typing import Any

from pdserve.engine.constrained.grammar_spec import (
    GRAMMAR_FIELDS,
    JSON_OBJECT_SCHEMA,
    InvalidGrammar,
    check_grammar,
    schema_text,
)
from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.frontend.tool_calls import ToolChoice, ToolRequestError, tool_choice

MAX_GRAMMAR_CHARS = 64 * 1024  # a JSON schema, regex or EBNF grammar's text (xgrammar's work grows with it)
# How deep a JSON schema's text may nest objects and arrays. xgrammar's schema conversion, which
# runs when the request arrives and holds the server's event loop, grows far faster than the
# nesting: 100 levels of nested object schemas (200 of JSON) take 0.3 s, 200 take 2.4 s, 400 take
# 20 s, all well under the character cap.
MAX_SCHEMA_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def json_depth(text: str) -> int:
    """How deep objects and arrays nest in the JSON ``text`` (0 for a scalar), strings skipped."""
    depth = deepest = 0
    for ch in _JSON_STRING.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def sglang_grammars(obj) -> dict[str, Any]:
    """SGLang's grammar fields of a body (or its sampling_params), by name."""
    return {name: getattr(obj, name) for name in GRAMMAR_FIELDS}


def one_grammar(prefix: str, given: dict[str, Any]) -> dict[str, str]:
    """The one grammar among ``given`` (field name -> value, None: absent) as SamplingParams
    fields, parsed now so that a bad one is a 400 naming its field before anything is scheduled."""
    present = {k: v for k, v in given.items() if v is not None}
    if len(present) > 1:
        a, b = list(present)[:2]
        raise RequestError(f"{b} cannot be combined with {a}: give at most one grammar", param=f"{prefix}{b}")
    if not present:
        return {}
    (name, value), = present.items()
    kind = name if name in GRAMMAR_FIELDS else "json_schema"
    try:
        text = schema_text(name, value) if kind == "json_schema" else value
        if isinstance(text, str) and len(text) > MAX_GRAMMAR_CHARS:
            raise RequestError(f"{prefix}{name} has {len(text)} characters; a grammar may have at most "
                               f"{MAX_GRAMMAR_CHARS}", param=f"{prefix}{name}")
        if kind == "json_schema" and isinstance(text, str) and (depth := json_depth(text)) > MAX_SCHEMA_DEPTH:
            raise RequestError(f"{prefix}{name} nests {depth} levels deep; a JSON schema may nest at most "
                               f"{MAX_SCHEMA_DEPTH}", param=f"{prefix}{name}")
        check_grammar(kind, text, name)
    except InvalidGrammar as e:
        raise RequestError(f"{prefix}{e}", param=f"{prefix}{e.field}") from None
    return {kind: text}


def response_format_schema(rf: Any) -> tuple[str, Any] | None:
    """(field name, JSON schema) that ``response_format`` holds the output to; None for text."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if rf is None or kind == "text":
        return None
    if kind == "json_object":
        return "response_format", JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
        return "response_format.json_schema.schema", spec["schema"]
    raise RequestError("response_format.type must be text, json_object or json_schema", param="response_format.type")


def chat_tools(req, limits) -> ToolChoice:
    """The chat request's ``tools`` and ``tool_choice``, checked against ``--tool-call-parser``."""
    try:
        return tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, limits.tool_call_parser)
    except ToolRequestError as e:
        raise RequestError(str(e), param=e.param) from None
