"""The rules of migrating an OpenAI stream (router/migration/openai_migration.py): pure logic, no sockets."""

from __future__ import annotations

import msgspec

from pdserve.router.migration.migration import parse_event
from pdserve.router.migration.openai_migration import (CHAT, COMPLETIONS, OpenAITranscript, openai_continuation,
                                             openai_migratable, openai_tokens_left, with_token_ids)


def ev(obj: dict):
    return parse_event(b"data: " + msgspec.json.encode(obj) + b"\n\n")


def out(raw: bytes) -> dict | None:
    return msgspec.json.decode(raw[6:]) if raw else None


def chat_chunk(content=None, ids=None, finish=None, role=False, prompt_ids=None):
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content or not finish else {})
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    o = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [c]}
    if prompt_ids is not None:
        o["prompt_token_ids"] = prompt_ids
    return o


def cmpl_chunk(text, ids, finish=None, rid="cmpl-b"):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None,
         "token_ids": ids}
    return {"id": rid, "object": "text_completion", "created": 9, "model": "m", "choices": [c]}


def test_what_is_migratable():
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
    assert openai_migratable(CHAT, chat)
    assert not openai_migratable(CHAT, {**chat, "stream": False})
    assert openai_migratable(CHAT, {k: v for k, v in chat.items() if k != "max_tokens"})  # the room's budget
    assert openai_migratable(CHAT, {**chat, "max_tokens": None, "max_completion_tokens": 4})
    for bad in ({"n": 2}, {"logprobs": True}, {"tools": [{"type": "function"}]}, {"regex": "a+"},
                {"response_format": {"type": "json_object"}}):
        assert not openai_migratable(CHAT, {**chat, **bad}), bad
    comp = {"prompt": "hello", "stream": True}
    assert openai_migratable(COMPLETIONS, comp) and openai_migratable(COMPLETIONS, {**comp, "prompt": [1, 2]})
    for bad in ({"prompt": ["a", "b"]}, {"echo": True}, {"logprobs": 0}, {"suffix": "x"}):
        assert not openai_migratable(COMPLETIONS, {**comp, **bad}), bad
    assert not openai_migratable("/generate", comp)
    assert with_token_ids(chat)["return_token_ids"] is True and "return_token_ids" not in chat


def test_continuation_is_a_completion_of_prompt_and_sent_ids():
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 10,
            "min_tokens": 4, "temperature": 0.5, "seed": 3, "stop": ["x"], "rid": "r1",
            "stream_options": {"include_usage": True}}
    cont = openai_continuation(chat, [1, 2], [7, 8, 9])
    assert cont == {"prompt": [1, 2, 7, 8, 9], "max_tokens": 7, "min_tokens": 1, "temperature": 0.5, "seed": 3,
                    "stop": ["x"], "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
    assert openai_continuation({"prompt": "a", "stream": True}, [1], [5])["max_tokens"] == 15  # default 16
    # a chat without a budget: what its first decode server's room left, capped by the new pair's
    bare = {"messages": chat["messages"], "stream": True}
    assert openai_continuation(bare, [1, 2], [7, 8, 9], room=100)["max_tokens"] == 95
    assert "max_tokens" not in openai_continuation(bare, [1, 2], [7], room=None)
    assert openai_tokens_left(bare, 3, 2, 100) == 95 and openai_tokens_left(bare, 3, 2, None) is None


def test_chat_stream_continued_reads_as_one_answer_without_ids():
    tr = OpenAITranscript(chat=True, client_wants_ids=False, include_usage=True)
    first = out(tr.accept(ev(chat_chunk(role=True, prompt_ids=[1, 2, 3]))))
    assert "prompt_token_ids" not in first and first["choices"][0]["delta"]["role"] == "assistant"
    assert out(tr.accept(ev(chat_chunk("He", [10])))) == {
        "id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "He"}, "logprobs": None, "finish_reason": None}]}
    assert tr.accept(ev(chat_chunk("", [11]))) == b""  # ids of held-back text only: not for the client
    assert tr.prompt_ids == [1, 2, 3] and tr.ids == [10, 11]
    tr.new_leg()
    a = out(tr.accept(ev(cmpl_chunk("llo", [12]))))
    assert a["id"] == "chatcmpl-a" and a["object"] == "chat.completion.chunk" and a["created"] == 7
    assert a["choices"] == [{"index": 0, "delta": {"content": "llo"}, "logprobs": None, "finish_reason": None}]
    assert a["pdserve_migrations"] == 1
    b = out(tr.accept(ev(cmpl_chunk("", [13], finish="length"))))
    assert b["choices"][0]["delta"] == {} and b["choices"][0]["finish_reason"] == "length"
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    u = out(tr.accept(ev({"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "m",
                          "choices": [], "usage": usage})))
    assert u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}  # the whole answer once
    assert u["id"] == "chatcmpl-a" and u["choices"] == []
    assert tr.tail() == b""


def test_completion_stream_keeps_ids_the_client_asked_for_and_owes_its_usage():
    tr = OpenAITranscript(chat=False, client_wants_ids=True, include_usage=True)
    raw = ev({**cmpl_chunk("a", [4], rid="cmpl-a"), "choices": [{**cmpl_chunk("a", [4])["choices"][0],
                                                                  "prompt_token_ids": [1, 2]}]})
    assert tr.accept(raw) == raw.raw  # untouched before a move
    tr.new_leg()
    a = out(tr.accept(ev(cmpl_chunk("b", [5], finish="stop"))))
    assert a["id"] == "cmpl-a" and a["choices"][0]["token_ids"] == [5] and tr.finished
    # the leg died after its finish but before its usage chunk: the relay sends it
    u = out(tr.tail())
    assert u["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert u["pdserve_migrations"] == 1 and tr.tail() == b""


def test_a_server_that_sends_no_ids_makes_the_stream_unmigratable():
    tr = OpenAITranscript(chat=False, client_wants_ids=False, include_usage=False)
    tr.accept(ev({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}))
    assert tr.ids_missing and tr.ids == []
