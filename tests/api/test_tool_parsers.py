"""Each ``--tool-call-parser`` format on its documented examples: one call, parallel calls, the text
streamed in small chunks, and malformed calls (left as content, never an error)."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.frontend.tool_calls import ToolCallStream, ToolPlan
from pdserve.engine.text.tool_parsers import TOOL_CALL_PARSERS, make_tool_call_parser

FUNCTIONS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}}},
    "get_time": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_time", {"city": "Tokyo"})

# name -> [(model output, expected content, expected calls)], written from each format's documentation
EXAMPLES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
         "Let me check.", [PARIS]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {"city": "Tokyo"}}</tool_call>', "", [PARIS, TOKYO]),
    ],
    "llama3": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [PARIS]),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "get_time", "parameters": {"city": "Tokyo"}}', "", [PARIS, TOKYO]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', "", [PARIS]),
        ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "arguments": {"city": "Tokyo"}}]', "Sure.", [PARIS, TOKYO]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"city": "Tokyo"}',
         "", [PARIS, TOKYO]),
    ],
    "deepseekv3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [PARIS]),
        ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
         '```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking.", [PARIS, TOKYO]),
    ],
    "deepseekv31": [
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
         '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Tokyo"}<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", "", [PARIS, TOKYO]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3)]', "", [PARIS]),
        ('I will look.\n[get_weather(city="Paris", days=3), get_time(city="Tokyo")]', "I will look.", [PARIS, TOKYO]),
        ('<|python_start|>[get_time(city="Tokyo")]<|python_end|>', "", [TOKYO]),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n</function>\n</tool_call>", "", [PARIS]),
        ("Two calls.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
         "<parameter=city>\nTokyo\n</parameter>\n</function>\n</tool_call>", "Two calls.", [PARIS, TOKYO]),
    ],
    "glm45": [
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
         "<arg_value>3</arg_value>\n</tool_call>", "", [PARIS]),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
         "<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n<arg_key>city</arg_key>\n"
         "<arg_value>Tokyo</arg_value>\n</tool_call>", "", [PARIS, TOKYO]),
    ],
    "kimi_k2": [
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
         '<|tool_call_argument_begin|>{"city": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>', "",
         [PARIS, TOKYO]),
    ],
}
EXAMPLES["qwen25"] = EXAMPLES["qwen"] = EXAMPLES["hermes"]

MALFORMED = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": 3]',
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{oops}\n```"
                  "<｜tool▁call▁end｜>",
    "deepseekv31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
    "pythonic": "[get_weather(city=open('/etc/passwd').read())]",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
    "glm45": "<tool_call>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               "not json<|tool_call_end|><|tool_calls_section_end|>",
}
MALFORMED["qwen25"] = MALFORMED["qwen"] = MALFORMED["hermes"]


def test_every_parser_has_examples():
    assert set(EXAMPLES) == set(TOOL_CALL_PARSERS) == set(MALFORMED)


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


CASES = [(name, i) for name in sorted(EXAMPLES) for i in range(len(EXAMPLES[name]))]


@pytest.mark.parametrize("name,i", CASES)
def test_whole(name, i):
    text, content, calls = EXAMPLES[name][i]
    got_content, got_calls = make_tool_call_parser(name, FUNCTIONS).parse(text)
    assert (got_content, _calls(got_calls)) == (content, [(n, a) for n, a in calls])


def _stream(name, text, step):
    s = ToolCallStream(ToolPlan("auto", parser=make_tool_call_parser(name, FUNCTIONS)))
    deltas = [d for i in range(0, len(text), step) for d in s.feed(text[i:i + step], False)] + s.feed("", True)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for d in deltas for c in d.get("tool_calls", [])]
    return content, calls


@pytest.mark.parametrize("name,i", CASES)
@pytest.mark.parametrize("step", [1, 3, 8])
def test_streamed_in_small_chunks(name, i, step):
    text, content, calls = EXAMPLES[name][i]
    got_content, got_calls = _stream(name, text, step)
    assert got_calls == [(n, a) for n, a in calls]
    assert got_content.strip() == content


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_stays_content(name):
    text = MALFORMED[name]
    assert make_tool_call_parser(name, FUNCTIONS).parse(text) == (text, [])
    assert _stream(name, text, 2) == (text, [])


def test_plain_text_passes_through():
    for name in TOOL_CALL_PARSERS:
        assert make_tool_call_parser(name).parse("The weather is fine.") == ("The weather is fine.", [])
        assert _stream(name, "The weather is fine.", 2) == ("The weather is fine.", [])


def test_typed_parameters_follow_the_schema():
    parser = make_tool_call_parser("qwen3_coder", FUNCTIONS)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n"
            "seven\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")
    _, calls = parser.parse(text)
    assert json.loads(calls[0].arguments) == {"city": "42", "days": "seven", "metric": True}
