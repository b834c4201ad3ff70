"""``--log-requests``: one JSON line per request per side, joined on ``bootstrap_room``, with the
stages in the order they happened (real loops in one process, ``loop_stand``; the multi-process
stand checks the same in the servers' logs: ``tests/pd/test_pd_observability.py``)."""

from __future__ import annotations

import json
import logging

import pytest
from loop_stand import PDPair

pytestmark = pytest.mark.timeout(60)

PREFIX = "pdserve.requests"


def lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == PREFIX]


def check_prefill_stages(stages: list[dict], min_chunks: int) -> None:
    """Ordered: queued, bootstrapped, each chunk computed before it is sent, success, finished.
    A chunk is a hand-off to the transfer threads: one per forward pass, and the last one."""
    names = [s["stage"] for s in stages]
    times = {(s["stage"], s.get("chunk")): s["t"] for s in stages}
    assert names[:2] == ["queued", "bootstrapped"] and names[-2:] == ["success", "finished"], names
    num_chunks = names.count("chunk_computed")
    assert num_chunks >= min_chunks
    assert sorted(s["chunk"] for s in stages if s["stage"] == "chunk_computed") == list(range(num_chunks))
    assert sorted(s["chunk"] for s in stages if s["stage"] == "chunk_sent") == list(range(num_chunks))
    for i in range(num_chunks):
        assert times[("bootstrapped", None)] <= times[("chunk_computed", i)] <= times[("chunk_sent", i)]
        assert times[("chunk_sent", i)] <= times[("success", None)]
    assert [s["t"] for s in stages] == sorted(s["t"] for s in stages)


def check_decode_stages(stages: list[dict]) -> None:
    assert [s["stage"] for s in stages] == ["queued", "preallocated", "kv_landed", "first_token", "finished"]
    assert [s["t"] for s in stages] == sorted(s["t"] for s in stages)


def join(records: list[dict]) -> dict[int, dict[str, dict]]:
    out: dict[int, dict[str, dict]] = {}
    for line in records:
        out.setdefault(line["bootstrap_room"], {})[line["side"]] = line
    return out


def test_one_line_per_side_joined_on_the_room(caplog):
    caplog.set_level(logging.INFO, logger=PREFIX)
    pair = PDPair(p_engine={"log_requests": True, "chunked_prefill_size": 8}, d_engine={"log_requests": True})
    try:
        rooms = {"short": pair.submit("short", [3, 4, 5], max_new=3),
                 "long": pair.submit("long", list(range(100, 130)), max_new=2)}  # 4 chunks of 8
        pair.run(pair.done("short", "long"))
        pair.settle()
    finally:
        pair.close()
    joined = join(lines(caplog))
    assert set(joined) == set(rooms.values())
    for rid, chunks in (("short", 1), ("long", 4)):
        sides = joined[rooms[rid]]
        assert set(sides) == {"prefill", "decode"}
        p, d = sides["prefill"], sides["decode"]
        assert p["rid"] == d["rid"] == rid
        assert p["finish_reason"] == "length" and d["finish_reason"] == "length"
        check_prefill_stages(p["stages"], chunks)
        check_decode_stages(d["stages"])
        t = {s["stage"]: s["t"] for s in d["stages"]}
        # across the sides: the KV landed after its last chunk was written
        last_sent = max(s["t"] for s in p["stages"] if s["stage"] == "chunk_sent")
        assert t["preallocated"] <= min(s["t"] for s in p["stages"] if s["stage"] == "chunk_computed")
        assert last_sent <= t["kv_landed"]


def test_off_by_default(caplog):
    caplog.set_level(logging.INFO, logger=PREFIX)
    pair = PDPair()
    try:
        pair.submit("a", [1, 2, 3], max_new=2)
        pair.run(pair.done("a"))
    finally:
        pair.close()
    assert lines(caplog) == []
