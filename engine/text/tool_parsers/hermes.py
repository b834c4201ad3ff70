"""Hermes / Qwen 2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

from __future__ import annotations

import re

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser, json_tool_call


class HermesParser(ToolCallParser):
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
