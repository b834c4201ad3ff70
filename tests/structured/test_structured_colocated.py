"""Structured output on a colocated server: random JSON schemas, regexes, EBNF, and 400s naming the field."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from structured_util import MAX_TOKENS, TWENTY_SCHEMAS, chat_content, check_schemas, generate_text

pytestmark = pytest.mark.timeout(900)


@settings(max_examples=1, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(schemas=TWENTY_SCHEMAS)
def test_random_schemas_validate(structured_server, schemas):
    check_schemas(structured_server.url, schemas)


def test_json_object_and_ebnf(structured_server):
    url = structured_server.url
    body = {"messages": [{"role": "user", "content": "Give me a JSON object about a cat."}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "response_format": {"type": "json_object"}}
    ebnf = {"text": "Is the sky blue?", "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 16, "ebnf": 'root ::= "The answer is " ("yes" | "no") "."'}}
    with cf.ThreadPoolExecutor(4) as ex:
        objects = [ex.submit(chat_content, url, body, stream) for stream in (False, True)]
        answers = [ex.submit(generate_text, url, ebnf, stream) for stream in (False, True)]
        for f in objects:
            assert isinstance(json.loads(f.result()), dict)
        for f in answers:
            assert f.result()[0] in ("The answer is yes.", "The answer is no."), f.result()


PATTERNS = [r"\d{3}-\d{3}-\d{4}", r"(cat|dog|bird)s? [a-z]{2,5}", r"[A-Z][a-z]{1,8}, [0-9]{1,2}"]


def test_regex_outputs_match(structured_server):
    url = structured_server.url
    jobs = []
    with cf.ThreadPoolExecutor(16) as ex:
        for pattern in PATTERNS:
            for stream in (False, True):
                for temperature in (0, 1.0):
                    body = {"text": "Answer:", "sampling_params": {
                        "temperature": temperature, "max_new_tokens": 24, "regex": pattern}}
                    jobs.append((pattern, ex.submit(generate_text, url, body, stream)))
            chat = {"messages": [{"role": "user", "content": "Answer:"}], "max_tokens": 24, "regex": pattern}
            jobs.append((pattern, ex.submit(chat_content, url, chat, True)))
        for pattern, f in jobs:
            out = f.result()
            text = out[0] if isinstance(out, tuple) else out
            assert re.fullmatch(pattern, text), (pattern, text)
            if isinstance(out, tuple):
                assert out[1]["finish_reason"]["type"] == "stop", out


BAD = [
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "nope"}'}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "[a-"}}, "sampling_params.regex"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= undefined_rule"}}, "sampling_params.ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params.ebnf"),
    ("/v1/completions", {"prompt": "x", "regex": "(unclosed"}, "regex"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
            "a": {"type": "wrong"}}}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[b[2] + "-" + str(i) for i, b in enumerate(BAD)])
def test_invalid_grammar_is_400_naming_the_field(structured_server, path, body, param):
    r = requests.post(structured_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split(".")[-1] in err["message"], err
