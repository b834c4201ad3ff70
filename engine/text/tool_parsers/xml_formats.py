"""Formats whose arguments are tagged text, typed by the tool's parameters schema: Qwen3-Coder's
``<function=NAME><parameter=KEY>VALUE</parameter></function>`` and GLM-4.5's
``NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``, each inside ``<tool_call>...</tool_call>``."""

from __future__ import annotations

import ast
import json
import re

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def typed_value(raw: str, schema: dict | None):
    """A parameter's text as the type its schema names; text that does not read as that type stays text."""
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:
        return raw
    if raw.strip().lower() == "null":
        return None
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(raw.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if kind is None or _matches(value, kinds):
            return value
    return raw


def _matches(value, kinds) -> bool:
    types = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    return any(isinstance(value, types[k]) for k in kinds if k in types) and not (
        isinstance(value, bool) and "boolean" not in kinds)


class _TaggedParser(ToolCallParser):
    start = "<tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in _BLOCK.findall(text):
            call = self._call(body)
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        return text.split(self.start, 1)[0].strip(), calls

    def _args(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall:
        props = self.functions.get(name, {}).get("properties", {})
        args = {key: typed_value(value, props.get(key)) for key, value in pairs}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def _call(self, body: str) -> ToolCall | None:
        raise NotImplementedError


class Qwen3CoderParser(_TaggedParser):
    _FUNC = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _call(self, body: str) -> ToolCall | None:
        m = self._FUNC.fullmatch(body)
        if m is None:
            return None
        rest = self._PARAM.sub("", m.group(2))
        if rest.strip():  # text that is no parameter: not this format
            return None
        return self._args(m.group(1).strip(), self._PARAM.findall(m.group(2)))


class Glm45Parser(_TaggedParser):
    _CALL = re.compile(r"\s*([^<\n]+?)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.DOTALL)
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _call(self, body: str) -> ToolCall | None:
        m = self._CALL.fullmatch(body)
        if m is None:
            return None
        return self._args(m.group(1), [(k.strip(), v) for k, v in self._PAIR.findall(m.group(2))])
