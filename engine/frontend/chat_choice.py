"""A chat choice's text as OpenAI's message parts: reasoning, content and tool calls, whole or streamed.

The reasoning parser (when the request has a plan that separates reasoning; with
``separate_reasoning: false`` the whole text is the content) splits the thinking off first;
the tool plan then reads only the answer, so a call written while thinking is
never taken for a call, and a grammar held the answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.frontend.reasoning_fields import ReasoningPlan
from pdserve.engine.frontend.tool_calls import ToolCallStream, ToolPlan
from pdserve.engine.text.reasoning_parsers import ReasoningStream, split_reasoning
from pdserve.engine.text.tool_parsers import ToolCall


def whole_choice(text: str, reasoning: ReasoningPlan | None,
                 tools: ToolPlan | None) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning_content, content, tool calls) of a choice's whole text."""
    thought = None
    answer = text
    if reasoning is not None and reasoning.separate:
        thought, answer = split_reasoning(reasoning.fmt, text)
    if tools is None:
        return thought, answer, []
    content, calls = tools.parse(answer)
    return thought, content, calls


@dataclass
class ChatChoiceStream:
    """One streamed choice: text deltas in, chat ``delta`` dicts out."""

    reasoning: ReasoningPlan | None
    tools: ToolPlan | None
    _split: ReasoningStream | None = None
    _calls: ToolCallStream | None = None
    _unsent_reasoning: str = ""  # stream_reasoning false: the thinking, sent whole when it ends
    _deltas: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self):
        if self.reasoning is not None and self.reasoning.separate:
            self._split = ReasoningStream(self.reasoning.fmt)
        if self.tools is not None:
            self._calls = ToolCallStream(self.tools)

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls if self._calls is not None else 0

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        answer = text
        if self._split is not None:
            thought, answer = self._split.feed(text, finished)
            if thought:
                if self.reasoning.stream:
                    out.append({"reasoning_content": thought})
                else:
                    self._unsent_reasoning += thought
            if self._unsent_reasoning and (self._split.state == "answer" or finished):
                out.append({"reasoning_content": self._unsent_reasoning})
                self._unsent_reasoning = ""
        if self._calls is not None:
            out.extend(self._calls.feed(answer, finished))
        elif answer:
            out.append({"content": answer})
        return out
