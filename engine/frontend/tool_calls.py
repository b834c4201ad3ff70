"""OpenAI ``tools`` / ``tool_choice``: the grammar a request is held to, and its output as ``tool_calls``.

- ``required``: the output is constrained to a JSON array of calls,
  ``[{"name": <one of the tools>, "parameters": {...}}, ...]``;
- a named function: the output is constrained to that function's parameters
  schema, and is the call's arguments;
- ``auto``: the output is free; the server's ``--tool-call-parser`` finds the
  calls in the model's own format;
- ``none`` (or no tools): plain content.

``ToolPlan.parse`` turns a whole output into (content, calls); ``ToolCallStream``
turns a streamed output into chat deltas, streaming a named call's arguments as
they come and emitting the other calls once they are complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.text.tool_parsers import ToolCall, ToolCallParser, json_tool_call, make_tool_call_parser


class ToolRequestError(ValueError):
    """A bad ``tools`` / ``tool_choice``; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "required" | "named" | "auto"
    function: str | None = None  # the named function
    parser: ToolCallParser | None = None  # auto: the server's parser

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a choice's whole text."""
        if self.mode == "named":
            return None, [ToolCall(self.function, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: the text is all there is
                return text, []
            calls = [json_tool_call(json.dumps(item)) for item in items]
            return None, [c for c in calls if c is not None]
        content, calls = self.parser.parse(text)
        return content or None, calls


@dataclass
class ToolCallStream:
    """One streamed choice of a request with tools: text deltas in, chat delta dicts out."""

    plan: ToolPlan
    held: str = ""  # text not yet sent: a (possible) call in progress
    num_calls: int = 0
    streamed_named: bool = False

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The ``delta`` objects to send for ``text`` (new since the last feed)."""
        plan = self.plan
        if plan.mode == "named":
            out = []
            if not self.streamed_named:
                self.streamed_named = True
                first = ToolCall(plan.function, "").to_dict(0)
                out.append({"tool_calls": [first]})
                self.num_calls = 1
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        self.held += text
        if plan.mode == "auto":
            cut = plan.parser.hold_from(self.held)  # all before it is content
            if cut > 0 and not finished:
                content, self.held = self.held[:cut], self.held[cut:]
                return [{"content": content}]
        if not finished:
            return []
        content, calls = plan.parse(self.held)
        self.held = ""
        out = []
        if content:
            out.append({"content": content})
        if calls:
            out.append({"tool_calls": [c.to_dict(i) for i, c in enumerate(calls)]})
            self.num_calls = len(calls)
        return out


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's ``tools`` and ``tool_choice`` ask for."""

    plan: ToolPlan | None  # None: plain content
    json_schema: str | None = None  # the grammar the output is held to
    template_tools: list[dict] = field(default_factory=list)  # for the chat template


def tool_choice(tools: Any, choice: Any, parallel_tool_calls: Any, parser_name: str | None) -> ToolChoice:
    """Validate ``tools`` and ``tool_choice``; raise ToolRequestError naming the bad field."""
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return ToolChoice(None)
    functions = _functions(tools)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return ToolChoice(None, template_tools=list(tools))
    if choice == "auto":
        if parser_name is None:
            raise ToolRequestError("tool_choice auto needs a server started with --tool-call-parser "
                                   "(or give tool_choice required or a function)", "tool_choice")
        parser = make_tool_call_parser(parser_name, functions)
        return ToolChoice(ToolPlan("auto", parser=parser), template_tools=list(tools))
    if choice == "required":
        variants = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                      "parameters": params},
                     "required": ["name", "parameters"]} for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolChoice(ToolPlan("required"), json.dumps(schema), list(tools))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolRequestError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in functions:
        raise ToolRequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice(ToolPlan("named", function=name), json.dumps(functions[name]), list(tools))


def _functions(tools: Any) -> dict[str, dict]:
    """name -> parameters schema of each function tool."""
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be a list", "tools")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolRequestError('each tool must be {"type": "function", "function": {"name": ...}}',
                                   f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolRequestError("parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        out[fn["name"]] = params
    return out
