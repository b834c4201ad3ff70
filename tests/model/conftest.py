"""The model tests' helpers (in ``tests/model_util.py``, shared with the TP tests)."""

from __future__ import annotations

import pytest
from model_util import greedy_generate, hf_greedy, make_tiny_checkpoint  # noqa: F401  (test_hf_parity imports them from here)


@pytest.fixture
def greedy():
    return greedy_generate
