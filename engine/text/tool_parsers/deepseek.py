"""DeepSeek's tool calls: V3's (a name and a fenced JSON block per call) and V3.1's (a name and raw JSON)."""

from __future__ import annotations

import re

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser, json_arguments

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)


class _DeepSeekParser(ToolCallParser):
    start = CALLS_BEGIN
    _BODY: re.Pattern

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        content, rest = text.split(self.start, 1)
        calls = []
        for body in CALL.findall(rest):
            m = self._BODY.fullmatch(body)
            args = json_arguments(m.group(2)) if m else None
            if args is None:
                return text, []
            calls.append(ToolCall(m.group(1).strip(), args))
        if not calls:
            return text, []
        return content.strip(), calls


class DeepSeekV3Parser(_DeepSeekParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
    ...<｜tool▁calls▁end｜>``."""

    _BODY = re.compile(r"\s*function<｜tool▁sep｜>(.+?)\s*\n```json\s*\n(.*?)\n?```\s*", re.DOTALL)


class DeepSeekV31Parser(_DeepSeekParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``."""

    _BODY = re.compile(r"\s*(.+?)<｜tool▁sep｜>(.*?)\s*", re.DOTALL)
