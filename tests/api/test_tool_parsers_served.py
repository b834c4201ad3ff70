"""A served model's tool calls in another format than Hermes, after its thinking: ``--tool-call-parser
pythonic --reasoning-parser deepseek-r1``, the default model's output forced by a regex into
``thinking</think>[get_weather(...), get_time(...)]``, whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest
from support.pd_stand import Server

pytestmark = pytest.mark.timeout(600)

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for name in ("get_weather", "get_time")]
SHAPE = r'[a-z]{2,8}( [a-z]{2,8}){0,2}</think>\[get_weather\(city="[A-Z][a-z]{2,6}"\), get_time\(city="Paris"\)\]'
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def client():
    s = Server("tools", "null", "--max-total-tokens", "2048", "--tool-call-parser", "pythonic",
               "--reasoning-parser", "deepseek-r1")
    try:
        s.wait_ready()
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none")
    finally:
        s.stop()


def _ask(client, stream):
    return client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                          max_tokens=64, temperature=0, stream=stream, extra_body={"regex": SHAPE})


def test_calls_after_thinking_whole_and_streamed(client):
    choice = _ask(client, False).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content and "</think>" not in choice.message.reasoning_content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert [n for n, _ in calls] == ["get_weather", "get_time"] and calls[1][1] == {"city": "Paris"}
    reasoning, streamed, finish = "", {}, None
    for chunk in _ask(client, True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                streamed[d.index] = (d.function.name, json.loads(d.function.arguments))
    assert finish == "tool_calls" and reasoning == choice.message.reasoning_content
    assert [streamed[i] for i in sorted(streamed)] == calls
