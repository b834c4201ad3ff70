"""Fixtures of the server tests."""

from __future__ import annotations

import pytest
from server_helpers import TEST_MAX_TOTAL_TOKENS, TEST_NUM_THREADS


@pytest.fixture(scope="session")
def engine():
    """The offline Engine: the reference for greedy outputs (same pool size as the servers)."""
    from pdserve.entrypoints.engine import Engine

    eng = Engine(max_total_tokens=TEST_MAX_TOTAL_TOKENS, num_threads=TEST_NUM_THREADS)
    yield eng
    eng.shutdown()
