"""Soak: 1P1D behind the router, streamed requests of mixed lengths at concurrency 16; and the
hostile mix of ``scripts/soak.py --hostile`` (its requests, and the kinds that answer at once
against the same stand: each a 4xx, both pools unleaked afterwards).

Every request completes with exactly the tokens it asked for (ignore_eos) or ends with a JSON error;
none hangs past its deadline; afterwards every page is free on both sides (the starting count), and
the servers' and the router's /metrics agree with the client's counts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[2] / "scripts" / "soak.py")
soak = sys.modules["soak"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(soak)

from benchlib.hostile import (  # noqa: E402  (soak put scripts/ on sys.path)
    OVERSIZED_BYTES,
    hostile_requests,
    is_allowed,
    reply_complete,
    request_head,
    send_hostile,
    status_of,
)

from pdserve.engine.http_limits import MAX_REQUEST_BYTES  # noqa: E402
from pdserve.router.config import RouterConfig  # noqa: E402

N = 100


def test_soak_1p1d_every_request_accounted_for(pd11):
    P, D, R = pd11
    start = {s.name: soak.pages_free(s.url) for s in (P, D)}
    for name, (free, total, _) in start.items():
        assert free == total, f"{name} not idle at start: {free}/{total}"
    before = {s.name: soak.scrape(s.url) for s in (P, D, R)}
    t0 = time.monotonic()
    stats = asyncio.run(soak.run_load(R.url, n=N, concurrency=16, deadline=120, seed=11,
                                      prompt_lens=(1, 100), max_new=(1, 6)))
    took = time.monotonic() - t0
    c = stats.counts
    assert stats.sent == N and sum(c.values()) == N, (stats.sent, c)
    assert c["hung"] == 0, c
    assert stats.bad_token_counts == 0, "a completed request had the wrong number of tokens"
    # no faults here: every request must succeed
    assert c["completed"] == N, (c, stats.errors)
    for s in (P, D):
        free, total, states = soak.pages_free(s.url)
        assert (free, total) == start[s.name][:2], f"{s.name} leaked pages: {free}/{total} {states}"
    after = {s.name: soak.scrape(s.url) for s in (P, D, R)}

    def delta(name, metric, **labels):
        return soak.metric_sum(after[name], metric, **labels) - soak.metric_sum(before[name], metric, **labels)

    assert delta(D.name, "pdserve_generation_tokens_total") == stats.tokens_completed
    assert delta(D.name, "pdserve_requests_finished_total") == N
    assert delta(P.name, "pdserve_requests_finished_total") == N
    assert delta(R.name, "pdserve_router_requests_total", route="/generate", status="200") == N
    print(f"soak: {N} requests in {took:.1f}s, {stats.tokens_completed} tokens")


# ---------------------------------------------------------------------------- the hostile mix
# the kinds that answer at once (no trickling, no worker routes: this stand's router has no admin key)
QUICK = ("oversized_declared", "oversized_chunked", "huge_prompt", "schema_over_cap", "schema_deep",
         "stop_too_many", "stop_too_long", "n_too_large")


def test_hostile_requests_cover_each_attack_and_exceed_the_limits():
    reqs = {r.kind: r for r in hostile_requests("http://127.0.0.1:1")}
    assert set(QUICK) | {"bogus_worker_add", "bogus_worker_remove", "slow_body", "slow_read", "regex_bomb",
                         "stop_at_cap"} == set(reqs)
    assert OVERSIZED_BYTES > max(MAX_REQUEST_BYTES, RouterConfig().max_payload_size)
    assert b"Content-Length: %d" % OVERSIZED_BYTES in request_head(reqs["oversized_declared"], "h")
    assert b"Transfer-Encoding: chunked" in request_head(reqs["oversized_chunked"], "h")
    assert len(reqs["huge_prompt"].body) < MAX_REQUEST_BYTES
    for r in reqs.values():  # no kind accepts a server error or a hang
        assert not any(s >= 500 for s in r.allowed) and not is_allowed(r, "hung") and not is_allowed(r, "closed")
    assert status_of(b"HTTP/1.1 413 Payload Too Large\r\n\r\n") == 413 and status_of(b"") is None
    refusal = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\n\r\n{}"
    assert reply_complete(refusal) and not reply_complete(refusal[:-1])


def test_quick_hostile_kinds_are_refused_and_leave_the_stand_serving(pd11):
    P, D, R = pd11
    reqs = [r for r in hostile_requests(D.url) if r.kind in QUICK]
    outcomes = {r.kind: asyncio.run(send_hostile(R.url, r, deadline=120)) for r in reqs}
    assert all(is_allowed(r, outcomes[r.kind]) for r in reqs), outcomes
    for s in (P, D):
        s.wait_unleaked()  # and healthy; the soak above checks serving under load on the same stand
