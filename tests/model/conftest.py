"""The model tests' helpers (in ``tests/model_util.py``, shared with the TP tests)."""

from __future__ import annotations

import pytest
from support.model_util import greedy_generate, make_tiny_checkpoint


@pytest.fixture
def greedy():
    return greedy_generate


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def ckpt(request, tmp_path_factory):
    """A tiny random checkpoint of each architecture, written once per test module."""
    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}"))
    make_tiny_checkpoint(request.param, path)
    return path
