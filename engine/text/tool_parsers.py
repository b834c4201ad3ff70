"""Tool-call parsers for ``tool_choice: "auto"``: the model's own tool-call format to OpenAI's ``tool_calls``.

Chosen by ``--tool-call-parser`` (SGLang's flag); the registry's names are the
flag's choices. A parser takes a choice's whole text (``parse``) or its text as
it streams (``StreamingToolCalls``, which holds back whatever may still turn out
to be a call).
"""

from __future__ import annotations

import json
import re
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
    """Splits a model's output into plain content and tool calls."""

    # text that opens a tool call; content streams up to it
    start: str = ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content outside tool calls, the calls found), for a choice's whole text."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """Hermes/Qwen 2.5 style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call."""

    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for body in self._CALL.findall(text):
            call = json_tool_call(body)
            if call is None:  # not a well-formed call: it stays in the content
                return text, []
            calls.append(call)
        content = text.split(self.start, 1)[0] if calls else text
        return content.strip() if calls else content, calls


def json_tool_call(body: str) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a ToolCall, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


# --tool-call-parser names (SGLang's): qwen25 writes the hermes format
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen25": HermesParser}


def make_tool_call_parser(name: str) -> ToolCallParser:
    """The parser of a ``--tool-call-parser`` name (``ServerConfig`` checked it)."""
    return TOOL_CALL_PARSERS[name]()
