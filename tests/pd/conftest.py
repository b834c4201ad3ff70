"""Fixtures of the PD tests: the colocated server is the reference for every greedy output."""

from __future__ import annotations

import pytest
from support.otlp_receiver import OtlpReceiver
from support.pd_stand import Server


@pytest.fixture(scope="session")
def colocated():
    s = Server("colocated", "null", "--max-total-tokens", "4096")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference(colocated):
    """Greedy output ids of the colocated server, memoized per (prompt, max_new)."""
    from support.pd_stand import greedy_body

    cache: dict = {}

    def ref(ids: list[int], max_new: int) -> list[int]:
        key = (tuple(ids), max_new)
        if key not in cache:
            r = colocated.post("/generate", greedy_body(ids, max_new))
            assert r.status_code == 200, r.text
            cache[key] = r.json()["output_ids"]
        return cache[key]

    return ref


@pytest.fixture(scope="module")
def otlp():
    """An in-process OTLP/HTTP receiver, one per test module (the tracing servers export to it)."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()
