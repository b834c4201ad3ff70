"""What every tool-call parser shares: the call value, the parser's interface, and JSON call bodies."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_dict(self, index: int | None = None) -> dict:
        """OpenAI's tool call object; ``index``: its place among a streamed choice's calls."""
        d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


class ToolCallParser:
    """Splits a model's output into plain content and tool calls.

    ``functions`` (name -> parameters JSON schema, the request's tools) lets a format
    whose arguments are text (XML-like parameters) type them as the schema says."""

    # text that opens a tool call; content streams up to it, the rest is held until the output ends
    start: str = ""

    def __init__(self, functions: dict[str, dict] | None = None):
        self.functions = functions or {}

    def hold_from(self, text: str) -> int:
        """Where a streamed text must start being held back: at the opening text, or at a tail that may
        still become it; ``len(text)`` when all of it is content."""
        cut = text.find(self.start)
        if cut >= 0:
            return cut
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if text.endswith(self.start[:k]):
                return len(text) - k
        return len(text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content outside tool calls, the calls found), for a choice's whole text. A call that does
        not parse leaves the whole text as content and no calls."""
        raise NotImplementedError


def json_tool_call(body: str) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a ToolCall, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return dict_tool_call(obj)


def dict_tool_call(obj) -> ToolCall | None:
    """A decoded ``{"name": ..., "arguments"|"parameters": {...}}`` as a ToolCall, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_arguments(text: str) -> str | None:
    """Arguments given as a JSON object's text, re-encoded; None when it is not an object."""
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
