"""Kimi K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}
<|tool_call_end|>...<|tool_calls_section_end|>``."""

from __future__ import annotations

import re

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser, json_arguments

_CALL = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*<\|tool_call_end\|>",
                   re.DOTALL)
_ID = re.compile(r"(?:functions\.)?([^:\s]+)(?::\d+)?")


class KimiK2Parser(ToolCallParser):
    start = "<|tool_calls_section_begin|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        content, rest = text.split(self.start, 1)
        calls = []
        for call_id, body in _CALL.findall(rest):
            m = _ID.fullmatch(call_id)
            args = json_arguments(body)
            if m is None or args is None:
                return text, []
            calls.append(ToolCall(m.group(1), args))
        if not calls:
            return text, []
        return content.strip(), calls
