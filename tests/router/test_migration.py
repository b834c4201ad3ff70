"""Request migration's pure parts (router/migration/migration.py): events, the transcript, the continuation."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.router.cli import build_parser, config_from_args
from pdserve.router.config import RouterConfig
from pdserve.router.migration.migration import (SSEEvents, Transcript, continuation_body, migratable, parse_event,
                                      tokens_left)


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def out(ids, text, completion, finish=None, rid="r1", prompt=5):
    return {"text": text, "output_ids": ids, "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": completion}}


def test_events_are_whole_however_the_bytes_are_cut():
    stream = sse(out([7], "a", 1)) + sse(out([7, 8], "ab", 2)) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        ev = SSEEvents()
        got = ev.feed(stream[:cut]) + ev.feed(stream[cut:])
        assert b"".join(got) == stream and len(got) == 3
    ev = SSEEvents()
    assert ev.feed(stream[:10]) == [] and ev.pending == stream[:10]


def test_parse_event_tells_done_error_and_output():
    assert parse_event(b"data: [DONE]\n\n").done
    e = parse_event(sse({"error": {"message": "draining timed out", "code": 503}}))
    assert e.error == ("draining timed out", 503) and e.server_side_error
    bad = parse_event(sse({"error": {"message": "bad field", "code": 400}}))
    assert bad.error is not None and not bad.server_side_error
    assert parse_event(sse(out([1], "x", 1))).obj["output_ids"] == [1]


def test_whole_output_stream_continued_reads_as_one_answer():
    """A server streaming whole outputs (the default): after a migration the continuation's
    events get what was sent in front, and the request's id, prompt and token counts."""
    tr = Transcript()
    assert tr.accept(parse_event(sse(out([7], "a", 1)))) == sse(out([7], "a", 1))  # as is
    tr.accept(parse_event(sse(out([7, 8], "ab", 2))))
    assert tr.deltas is False and tr.ids == [7, 8]
    tr.new_leg(deltas_hint=True)  # the stream told already: the hint is not used
    sent = msgspec.json.decode(tr.accept(parse_event(sse(out([9], "c", 1, rid="r2", prompt=7))))[6:])
    assert sent["output_ids"] == [7, 8, 9] and sent["text"] == "abc"
    meta = sent["meta_info"]
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["pdserve_migrations"]) == \
        ("r1", 5, 3, 1)
    sent = msgspec.json.decode(tr.accept(parse_event(sse(out([9, 4], "cd", 2, "length", "r2", 7))))[6:])
    assert sent["output_ids"] == [7, 8, 9, 4] and tr.finished and tr.text == "abcd"


def test_delta_stream_continued_keeps_deltas():
    tr = Transcript()
    tr.accept(parse_event(sse(out([7], "a", 1))))
    tr.accept(parse_event(sse(out([8], "b", 2))))
    assert tr.deltas is True and tr.ids == [7, 8] and tr.text == "ab"
    tr.new_leg(deltas_hint=False)
    sent = msgspec.json.decode(tr.accept(parse_event(sse(out([9], "c", 1, rid="r2"))))[6:])
    assert sent["output_ids"] == [9] and sent["meta_info"]["completion_tokens"] == 3
    assert tr.ids == [7, 8, 9]


@pytest.mark.parametrize("deltas", [False, True])
def test_one_token_then_death_uses_the_servers_mode(deltas):
    """One token-bearing event reads the same in both modes: the failed server's /server_info decides."""
    tr = Transcript()
    tr.accept(parse_event(sse(out([7], "a", 1))))
    assert tr.deltas is None
    tr.new_leg(deltas_hint=deltas)
    sent = msgspec.json.decode(tr.accept(parse_event(sse(out([8], "b", 1))))[6:])
    assert sent["output_ids"] == ([8] if deltas else [7, 8]) and tr.ids == [7, 8]


def test_continuation_body_keeps_sampling_and_shrinks_the_budget():
    body = {"text": "hello", "rid": "mine", "stream": True, "sampling_params": {
        "max_new_tokens": 10, "min_new_tokens": 4, "temperature": 0.7, "seed": 3}}
    c = continuation_body(body, [1, 2], [5, 6, 7])
    assert c["input_ids"] == [1, 2, 5, 6, 7] and "text" not in c and "rid" not in c
    assert c["sampling_params"] == {"max_new_tokens": 7, "min_new_tokens": 1, "temperature": 0.7, "seed": 3}
    assert body["sampling_params"]["max_new_tokens"] == 10  # the client's body is untouched
    assert tokens_left(body, 10) == 0 and tokens_left({"sampling_params": {}}, 3) is None


def test_what_is_migratable():
    assert migratable("/generate", {"input_ids": [1, 2], "stream": True})
    assert migratable("/generate", {"text": "hi", "stream": True, "sampling_params": {}})
    assert not migratable("/generate", {"text": "hi"})  # JSON: retried whole before its first byte
    assert not migratable("/v1/completions", {"prompt": "hi", "stream": True})  # text only
    assert not migratable("/generate", {"text": ["a", "b"], "stream": True})  # a batch
    assert not migratable("/generate", {"input_ids": [[1], [2]], "stream": True})
    assert not migratable("/generate", {"text": "hi", "stream": True, "return_logprob": True})


def test_migration_limit_flag():
    cfg = config_from_args(build_parser().parse_args(
        ["--prefill", "http://p:1", "--decode", "http://d:2", "--migration-limit", "3"]))
    assert cfg.migration_limit == 3 and RouterConfig().migration_limit == 0
    with pytest.raises(ValueError, match="migration_limit"):
        RouterConfig(migration_limit=-1)
