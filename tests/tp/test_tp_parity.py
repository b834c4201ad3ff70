"""fp32 greedy: a model split over TP processes gives exactly the tokens of the whole model.

Each run starts real processes joined by gloo (``tp_harness``); TP 1 runs in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.model_util import greedy_generate
from tp_harness import MAX_TOTAL_TOKENS, run_tp

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(3, 40)), [1] + [17, 250, 3] * 9]
NEW_TOKENS = 12


def tp1(model_path: str | None, prompts, new_tokens: int):
    runner = ModelRunner(EngineConfig(model_path=model_path, dtype="float32", max_total_tokens=MAX_TOTAL_TOKENS))
    return greedy_generate(runner, prompts, new_tokens)


@pytest.mark.parametrize("kind, tp", [("llama", 2), ("qwen3", 2), ("llama", 4), ("qwen3_moe", 2), ("gemma3", 2)])
def test_tiny_checkpoint_tp_equals_tp1(tiny_checkpoints, kind, tp):
    path = tiny_checkpoints[kind]
    want, want_logits = tp1(path, PROMPTS, NEW_TOKENS)
    got, got_logits, ranks = run_tp(path, tp, PROMPTS, NEW_TOKENS)
    assert got == want
    for a, b in zip(got_logits, want_logits):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
    # each rank's pool holds its KV heads only: 2 KV heads split over 2 ranks, or replicated over 4
    head_dim = 16 if kind == "llama" else 32
    assert {(shape[0], shape[3]) for shape, _ in ranks.values()} == {(1, head_dim)}  # [heads, pages, page, dim]
    shards = [ranks[r][1] for r in range(tp)]
    assert [s.kv_start for s in shards] == ([0, 1] if tp == 2 else [0, 0, 1, 1])
    assert len({shape[1] for shape, _ in ranks.values()}) == 1  # same page count on every rank


def test_default_model_tp3_equals_tp1():
    """SmolLM2-135M: 9 heads and 3 KV heads, three ranks of 3 heads and 1 KV head each."""
    prompts = [[1, 504, 3101, 314, 260, 1848, 30], list(range(1000, 1030))]
    torch.manual_seed(0)
    want, _ = tp1(None, prompts, 8)
    got, _, ranks = run_tp(None, 3, prompts, 8)
    assert got == want
    assert [ranks[r][1].kv_start for r in range(3)] == [0, 1, 2]
    assert {(shape[0], shape[3]) for shape, _ in ranks.values()} == {(1, 64)}
