"""OpenAI tools through the ``openai`` client: tool_choice required, a named function and auto
(the hermes parser), streamed and not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 12}},
                                               "required": ["city"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(structured_server):
    return openai.OpenAI(base_url=structured_server.url + "/v1", api_key="none")


def _check_calls(calls, names=tuple(SCHEMAS)):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream):
    """Tool calls assembled from streamed deltas, as an OpenAI client program does; and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                if d.function is not None:
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for _, c in sorted(calls.items())], finish


def test_tool_choice_required(client):
    # one call: left free to add calls, the small greedy model repeats its call until max_tokens
    extra = {"parallel_tool_calls": False}
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=96, temperature=0, **extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1
    calls, finish = _streamed_calls(client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0,
        stream=True, **extra))
    assert finish == "tool_calls"
    _check_calls(calls)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_named_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       max_tokens=64, temperature=0.7, seed=3)
    _check_calls(r.choices[0].message.tool_calls, ("get_time",))
    calls, finish = _streamed_calls(client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=64, temperature=0.7,
        seed=3, stream=True))
    assert finish == "tool_calls"
    _check_calls(calls, ("get_time",))
    assert calls[0].function.arguments == r.choices[0].message.tool_calls[0].function.arguments


# the small model does not write hermes calls by itself: a grammar makes it, and the parser must find them
HERMES = ('root ::= "Checking. <tool_call>{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"city\\": \\"" '
          '[A-Z] [a-z]{1,8} "\\"}}</tool_call>"')


def test_auto_parses_hermes_calls(client):
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                       max_tokens=96, temperature=0, extra_body={"ebnf": HERMES})
    msg = r.choices[0].message
    assert msg.content == "Checking." and r.choices[0].finish_reason == "tool_calls"
    _check_calls(msg.tool_calls, ("get_time",))
    stream = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                            max_tokens=96, temperature=0, extra_body={"ebnf": HERMES}, stream=True)
    content, calls = [], {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
    calls, finish = _streamed_calls(chunks)
    assert "".join(content).strip() == "Checking." and finish == "tool_calls"
    _check_calls(calls, ("get_time",))
    # without tools the same text is plain content
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=48, temperature=0,
                                       extra_body={"ebnf": HERMES})
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
