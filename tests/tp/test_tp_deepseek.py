"""DeepSeek-V3 (multi-head latent attention, DeepSeek MoE) at TP 2 in two real processes: the
tokens and logits of TP 1, and every rank's pool holding the whole latent (one vector per token,
identical on every rank) while the heads split."""

from __future__ import annotations

import numpy as np
import pytest
from support.deepseek_util import make_deepseek_checkpoint
from support.model_util import greedy_generate
from tp_harness import MAX_TOTAL_TOKENS, run_tp

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(3, 30))]
NEW_TOKENS = 8


@pytest.mark.parametrize("kind", ["v3"])
def test_deepseek_tp2_equals_tp1(tmp_path, kind):
    path = str(tmp_path)
    make_deepseek_checkpoint(kind, path)
    runner = ModelRunner(EngineConfig(model_path=path, dtype="float32", max_total_tokens=MAX_TOTAL_TOKENS))
    want, want_logits = greedy_generate(runner, PROMPTS, NEW_TOKENS)
    got, got_logits, ranks = run_tp(path, 2, PROMPTS, NEW_TOKENS)
    assert got == want
    for a, b in zip(got_logits, want_logits):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
    # [heads, pages, page, dim]: one latent "head" of kv_lora_rank + rope dim on each rank
    assert {(shape[0], shape[3]) for shape, _ in ranks.values()} == {(1, 40)}
    assert [ranks[r][1].num_heads for r in range(2)] == [2, 2]
