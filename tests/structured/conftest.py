"""Structured-output tests: a colocated server and a 1P1D pair behind the router, shared by the tests.

They reuse the PD tests' process helpers (``tests/support/pd_stand.py``).
"""

from __future__ import annotations

import sys

import pytest
from support.pd_stand import Proc, Server

from pdserve.entrypoints.procs import free_port, wait_healthy

# tool_choice auto finds hermes-style calls
SERVER_FLAGS = ("--max-total-tokens", "4096", "--tool-call-parser", "hermes")


@pytest.fixture(scope="session")
def structured_server():
    s = Server("structured", "null", *SERVER_FLAGS)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def structured_pd():
    """(router URL, prefill server, decode server): 1P1D over Mooncake behind the pdserve router."""
    P = Server("sP", "prefill", *SERVER_FLAGS)
    D = Server("sD", "decode", *SERVER_FLAGS)
    router = None
    try:
        P.wait_ready()
        D.wait_ready()
        port = free_port()
        router = Proc("srouter", [sys.executable, "-m", "pdserve.router", "--prefill", P.url, str(P.bootstrap_port),
                                  "--decode", D.url, "--host", "127.0.0.1", "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router.proc, 30, name="router", log=router.log)
        yield url, P, D
    finally:
        for p in (router, P, D):
            if p is not None:
                p.stop()
