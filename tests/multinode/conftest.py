"""Multi-node and migration tests reuse the PD tests' process helpers (``tests/support/pd_stand.py``)
and the server tests' (``tests/server/server_helpers.py``), and share one tiny Llama checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "server"))  # appended: never shadows a conftest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Llama (4 heads, 2 KV heads), made once for the multi-node tests."""
    from support.model_util import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    make_tiny_checkpoint("llama", path)
    return path
