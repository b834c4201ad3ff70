"""Reliability tests reuse the PD tests' process helpers (``tests/support/pd_stand.py``)."""

from __future__ import annotations

import pytest

LOAD_KV = ["--disaggregation-bootstrap-timeout", "120", "--disaggregation-waiting-timeout", "120"]


@pytest.fixture(scope="session")
def pd11():
    """1 prefill + 1 decode (small pools, fp32, 64-token chunks) and a router in front."""
    from support.pd_stand import Server
    from support.rel_stand import Router

    # KV timeouts sized for queueing under load: at concurrency 16 on 2 shared cores a room can wait
    # tens of seconds at the prefill, and the decode's waiting_timeout counts that wait (see docs/RELIABILITY.md)
    p = Server("rel-P", "prefill", "--max-total-tokens", "2048", *LOAD_KV)
    d = Server("rel-D", "decode", "--max-total-tokens", "2048", *LOAD_KV)
    r = None
    try:
        p.wait_ready()
        d.wait_ready()
        r = Router("rel-router", [p], [d]).wait_ready()
        yield p, d, r
    finally:
        for s in (r, p, d):
            if s is not None:
                s.stop()
