"""Expert parallelism: the tiny random Qwen3-MoE (8 experts, top 3) with its experts placed whole
on 2 ranks gives, in fp32 greedy, exactly transformers' tokens, whether the tokens reach the
experts by an all-reduce of replicated tokens (``none``) or by gloo's all-to-all (``gloo``).

Each run starts real processes joined by gloo (``tp_harness``); transformers runs in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.model_util import hf_greedy, hf_model
from tp_harness import run_tp

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(3, 40)), [1] + [17, 250, 3] * 9]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoints):
    model = hf_model(tiny_checkpoints["qwen3_moe"])
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


# "gloo-1": one sequence, so each decode step has 1 token and rank 1's share of it is empty: that
# rank still joins both all-to-alls and the all-gather with empty buffers
@pytest.mark.parametrize("backend, which", [("none", [0, 1, 2]), ("gloo", [0, 1, 2]), ("gloo", [1])],
                         ids=["none", "gloo", "gloo-1"])
def test_ep2_greedy_equals_transformers(tiny_checkpoints, hf_reference, backend, which):
    got, got_logits, _ = run_tp(tiny_checkpoints["qwen3_moe"], 2, [PROMPTS[i] for i in which], NEW_TOKENS,
                                timeout=540.0, ep_size=2, moe_a2a_backend=backend)
    assert got == [hf_reference[i][0] for i in which]
    for a, i in zip(got_logits, which):
        np.testing.assert_allclose(a, hf_reference[i][1].numpy(), atol=1e-4, rtol=0)
