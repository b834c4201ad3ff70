"""Pythonic calls (Llama 4, Llama 3.2's pythonic template): ``[get_weather(city="Paris", days=3), get_time()]``.

Arguments are Python literals, read with ``ast.literal_eval`` (never evaluated as code)."""

from __future__ import annotations

import ast
import json
import re

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser

_OPEN = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_OPEN = re.compile(r"\[\s*[A-Za-z_]?[\w.]*\s*$")
_TAGS = ("<|python_start|>", "<|python_end|>")


class PythonicParser(ToolCallParser):
    start = _TAGS[0]  # optional: a bare list of calls opens a call too

    def hold_from(self, text: str) -> int:
        m = _OPEN.search(text) or _MAYBE_OPEN.search(text)
        return min(m.start() if m else len(text), super().hold_from(text))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        clean = text
        for tag in _TAGS:
            clean = clean.replace(tag, "")
        m = _OPEN.search(clean)
        if m is None:
            return text, []
        body = clean[m.start():].strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            call = _call(node)
            if call is None:
                return text, []
            calls.append(call)
        return clean[:m.start()].strip(), calls


def _call(node: ast.AST) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            return None
    try:
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
        return None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
