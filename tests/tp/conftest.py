"""TP tests: tiny random checkpoints made once per session, and the server tests' ServerProcess."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# ServerProcess lives with the server tests, the attention reference with the kernel tests, the PD
# servers with the PD tests: the TP tests run the very same stands and reference
for folder in ("server", "kernels", "pd"):
    sys.path.append(str(Path(__file__).resolve().parents[1] / folder))  # appended: never shadows a conftest


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{"llama": dir, "qwen3": dir, "qwen3_moe": dir, "gemma3": dir}: 4 query heads, 2 KV heads,
    random weights, fp32."""
    from support.model_util import make_tiny_checkpoint

    out = {}
    for kind in ("llama", "qwen3", "qwen3_moe", "gemma3"):
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        make_tiny_checkpoint(kind, str(path))
        out[kind] = str(path)
    return out
