"""Reasoning parsers without a server: each format's split, whole and streamed in small chunks, and
the grammar that holds only the answer after the thinking."""

from __future__ import annotations

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from pdserve.engine.frontend.chat_choice import ChatChoiceStream, whole_choice
from pdserve.engine.frontend.reasoning_fields import ReasoningPlan, after_thinking, thinking_ebnf
from pdserve.engine.frontend.tool_calls import ToolPlan
from pdserve.engine.text.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningStream,
    split_reasoning,
    thinking_enabled,
)
from pdserve.engine.text.tool_parsers import make_tool_call_parser


def _streamed(fmt, text, step):
    s = ReasoningStream(fmt)
    parts = [s.feed(text[i:i + step], False) for i in range(0, len(text), step)] + [s.feed("", True)]
    return "".join(r for r, _ in parts), "".join(a for _, a in parts)


CASES = [  # (text, (reasoning, answer) for a format whose output starts inside the thinking, ... outside)
    ("<think>a < b</think>\n\nYes.", ("a < b", "Yes."), ("a < b", "Yes.")),
    ("two steps</think> Done", ("two steps", "Done"), (None, "two steps</think> Done")),
    ("plain answer", ("plain answer", ""), (None, "plain answer")),
    ("<think>cut short", ("cut short", ""), ("cut short", "")),
    ("  <think>x</think>y", ("x", "y"), ("x", "y")),
]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("case", CASES)
def test_split_whole_and_streamed(name, case):
    fmt = REASONING_PARSERS[name]
    def marked(t):
        return t if t is None else t.replace("<think>", fmt.start).replace("</think>", fmt.end)

    text = marked(case[0])
    want = tuple(map(marked, case[1] if fmt.starts_inside else case[2]))
    assert split_reasoning(fmt, text) == want
    for step in (1, 2, 3, 7):
        reasoning, answer = _streamed(fmt, text, step)
        assert (reasoning or None if want[0] is None else reasoning, answer) == want, step


def test_no_marker_leaks_into_a_delta():
    fmt = REASONING_PARSERS["qwen3"]
    s = ReasoningStream(fmt)
    deltas = [s.feed(c, False) for c in "<think>ab</think>cd"] + [s.feed("", True)]
    assert all("<" not in r and "<" not in a for r, a in deltas)
    assert [r for r, _ in deltas if r] == ["a", "b"] and "".join(a for _, a in deltas) == "cd"


def test_thinking_switches():
    assert thinking_enabled({}) and thinking_enabled({"enable_thinking": True})
    assert not thinking_enabled({"enable_thinking": False}) and not thinking_enabled({"thinking": False})


def test_stream_reasoning_off_sends_the_thinking_once():
    plan = ReasoningPlan(REASONING_PARSERS["deepseek-r1"], stream=False)
    s = ChatChoiceStream(plan, None)
    deltas = [d for c in "think more</think>ok" for d in s.feed(c, False)] + s.feed("", True)
    assert deltas == [{"reasoning_content": "think more"}, {"content": "o"}, {"content": "k"}]


def test_tool_calls_read_only_the_answer():
    plan = ReasoningPlan(REASONING_PARSERS["qwen3"])
    tools = ToolPlan("auto", parser=make_tool_call_parser("hermes"))
    inside = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    text = f"<think>maybe {inside}</think>\n" + inside.replace('"f"', '"g"')
    thought, content, calls = whole_choice(text, plan, tools)
    assert thought == f"maybe {inside}" and [c.name for c in calls] == ["g"] and not content
    s = ChatChoiceStream(plan, tools)
    deltas = [d for i in range(0, len(text), 4) for d in s.feed(text[i:i + 4], False)] + s.feed("", True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["g"]


def test_separate_reasoning_off_keeps_the_text_whole():
    plan = ReasoningPlan(REASONING_PARSERS["qwen3"], separate=False)
    assert whole_choice("<think>x</think>y", plan, None) == (None, "<think>x</think>y", [])


SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1", "kimi"])
def test_answer_grammar_after_free_thinking(name):
    fmt = REASONING_PARSERS[name]
    grammar = after_thinking(fmt, "json_schema", SCHEMA)
    s, e = fmt.start, fmt.end
    assert accepts(grammar, f'{s}a < b, {e[:3]}x and more{e}{{"a": 1}}')
    # the opening marker may be left out only where the prompt opened the thinking
    assert accepts(grammar, f'no opening marker{e}{{"a": 2}}') == fmt.starts_inside
    assert not accepts(grammar, f'{s}x{e}not json')
    assert not accepts(grammar, f'{s}x{e}y{e}{{"a": 1}}')  # the thinking ends at its first closing marker
    assert not accepts(grammar, '{"a": 1}')  # the thinking part is not optional
    assert accepts(after_thinking(fmt, "regex", "[A-Z]+"), f"{s}hm{e}OK")
    assert accepts(thinking_ebnf(fmt), f"{s}{s}{e}")
