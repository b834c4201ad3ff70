"""Helpers of the structured-output tests: random JSON schemas, and requests whose outputs must match them."""

from __future__ import annotations

import concurrent.futures as cf
import json

import jsonschema
import requests
from hypothesis import strategies as st

# every output must end within this budget: the schemas below bound every string, number and list
MAX_TOKENS = 96
PROMPT = "Reply with a JSON object for a record in a small database."

_names = st.sampled_from(["id", "name", "tags", "ok", "size", "kind", "note", "items"])

_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", "x"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
)


def _object(children):
    return st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req),
                         "additionalProperties": False}))


def _extend(children):
    return st.one_of(_object(children), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                                                  children, st.integers(0, 2)))


# an object at the top (what response_format json_schema asks for), two levels of nesting at most
SCHEMAS = _object(st.recursive(_leaf, _extend, max_leaves=3))


def check_json(text: str, schema: dict) -> None:
    """The output parses and validates: the assertion of every schema test."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise AssertionError(f"not JSON: {text!r} for {schema}") from exc
    jsonschema.validate(value, schema)


def generate_text(url: str, body: dict, stream: bool) -> tuple[str, dict]:
    """/generate's text (joined from the SSE events when streamed) and its final meta_info."""
    r = requests.post(url + "/generate", json={**body, "stream": stream}, timeout=300, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        return out["text"], out["meta_info"]
    last = None
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            last = json.loads(line[6:])
    return last["text"], last["meta_info"]


def chat_content(url: str, body: dict, stream: bool) -> str:
    """A chat completion's content (joined from the deltas when streamed)."""
    r = requests.post(url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=300, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    parts = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                parts.append(c["delta"].get("content") or "")
    return "".join(parts)


def check_schemas(url: str, schemas: list[dict]) -> None:
    """Each schema through /generate (sampling_params.json_schema) and chat (response_format),
    streamed and not, all at once (the server batches them): each output parses and validates."""
    jobs = []
    with cf.ThreadPoolExecutor(16) as ex:
        for schema in schemas:
            gen = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS,
                                                       "json_schema": json.dumps(schema)}}
            chat = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": MAX_TOKENS,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}
            for stream in (False, True):
                jobs.append((schema, ex.submit(generate_text, url, gen, stream)))
                jobs.append((schema, ex.submit(chat_content, url, chat, stream)))
        for schema, f in jobs:
            out = f.result()
            if isinstance(out, tuple):  # /generate: (text, meta_info)
                assert out[1]["finish_reason"]["type"] == "stop", out
                out = out[0]
            check_json(out, schema)


# 20 distinct schemas in one draw, sent together; no shrinking (each try costs a server round)
TWENTY_SCHEMAS = st.lists(SCHEMAS, min_size=20, max_size=20, unique_by=lambda s: json.dumps(s, sort_keys=True))
