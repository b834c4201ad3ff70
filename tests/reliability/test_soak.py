"""Soak: 1P1D behind the router, streamed requests of mixed lengths at concurrency 16.

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
