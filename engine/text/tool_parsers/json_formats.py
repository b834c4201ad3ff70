"""Formats whose calls are JSON objects after a marker: Llama 3 (``<|python_tag|>``) and Mistral (``[TOOL_CALLS]``)."""

from __future__ import annotations

import json
import re

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser, dict_tool_call, json_arguments


def _json_values(text: str) -> list | None:
    """The JSON values of ``text`` written one after another (separated by ``;``, ``,`` or whitespace)."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class Llama3Parser(ToolCallParser):
    """Llama 3.1/3.2 JSON calls: ``<|python_tag|>{"name": ..., "parameters": {...}}``, several separated by
    ``;``; an output that is only such JSON (no tag) is a call too, as Llama's zero-shot format writes it."""

    start = "<|python_tag|>"

    def hold_from(self, text: str) -> int:
        if text.lstrip().startswith("{"):
            return 0
        return super().hold_from(text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start in text:
            content, body = text.split(self.start, 1)
        elif text.lstrip().startswith("{"):
            content, body = "", text
        else:
            return text, []
        values = _json_values(body.replace(self.start, ";"))
        calls = [dict_tool_call(v) for v in values or []]
        if not calls or None in calls:
            return text, []
        return content.strip(), calls


class MistralParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` repeated once per call."""

    start = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\[ARGS\]\s*(.*)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        content, *bodies = text.split(self.start)
        calls: list[ToolCall | None] = []
        for body in bodies:
            named = self._NAMED.fullmatch(body)
            if named is not None:
                args = json_arguments(named.group(2).strip())
                calls.append(None if args is None else ToolCall(named.group(1), args))
                continue
            values = _json_values(body)
            if values is None or len(values) != 1:
                return text, []
            items = values[0] if isinstance(values[0], list) else [values[0]]
            calls.extend(dict_tool_call(v) for v in items)
        if not calls or None in calls:
            return text, []
        return content.strip(), calls
