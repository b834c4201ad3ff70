"""The model tests' helpers (in ``tests/model_util.py``, shared with the TP tests)."""

from __future__ import annotations

import pytest
from model_util import greedy_generate


@pytest.fixture
def greedy():
    return greedy_generate
