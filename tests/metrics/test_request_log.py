"""``--log-requests``: one JSON line per request per side, joined on ``bootstrap_room``, with the
stages in the order they happened (real loops in one process, ``loop_stand``; the multi-process
stand checks the same in the servers' logs: ``tests/pd/test_pd_observability.py``)."""

from __future__ import annotations

import json
import logging

import pytest
from support.loop_stand import PDPair
from support.request_log_util import LOGGER, check_decode_stages, check_joined, check_prefill_stages, join

pytestmark = pytest.mark.timeout(60)

def lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_one_line_per_side_joined_on_the_room(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
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
        check_joined(p, d)


def test_off_by_default(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    pair = PDPair()
    try:
        pair.submit("a", [1, 2, 3], max_new=2)
        pair.run(pair.done("a"))
    finally:
        pair.close()
    assert lines(caplog) == []
