"""Expert parallelism: the tiny random Qwen3-MoE (8 experts, top 3) with its experts placed whole
on 2 ranks gives, in fp32 greedy, exactly transformers' tokens, whether the tokens reach the
experts by an all-reduce of replicated tokens (``none``) or by gloo's all-to-all (``gloo``).
Each run is recorded by the expert recorder: each EP rank counts the slots routed to its own
experts, the dump sums both ranks' counts to tokens x top_k per layer, and the all-to-all's byte
and second counters moved with ``gloo`` only.

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
TOP_K, EXPERTS, LAYERS = 3, 8, 3


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoints):
    model = hf_model(tiny_checkpoints["qwen3_moe"])
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


# "gloo-1": one sequence, so each decode step has 1 token and rank 1's share of it is empty: that
# rank still joins both all-to-alls and the all-gather with empty buffers
@pytest.mark.parametrize("backend, which", [("none", [0, 1, 2]), ("gloo", [0, 1, 2]), ("gloo", [1])],
                         ids=["none", "gloo", "gloo-1"])
def test_ep2_greedy_equals_transformers(tiny_checkpoints, hf_reference, backend, which):
    prompts = [PROMPTS[i] for i in which]
    got, got_logits, ranks = run_tp(tiny_checkpoints["qwen3_moe"], 2, prompts, NEW_TOKENS,
                                    timeout=540.0, record_experts=True, ep_size=2, moe_a2a_backend=backend)
    assert got == [hf_reference[i][0] for i in which]
    for a, i in zip(got_logits, which):
        np.testing.assert_allclose(a, hf_reference[i][1].numpy(), atol=1e-4, rtol=0)

    # the prefill's tokens, then one per sequence for each further step
    tokens = sum(len(p) for p in prompts) + len(prompts) * (NEW_TOKENS - 1)
    own = [np.array(ranks[r][2]["own"]) for r in range(2)]
    half = EXPERTS // 2
    assert own[0][:, half:].sum() == 0 and own[1][:, :half].sum() == 0  # each rank counts its experts only
    assert own[0].sum() > 0 and own[1].sum() > 0
    dump = np.array(ranks[0][2]["dump"])
    assert dump.shape == (LAYERS, EXPERTS) and (dump == np.array(ranks[1][2]["dump"])).all()
    assert (dump == own[0] + own[1]).all()
    assert dump.sum(axis=1).tolist() == [tokens * TOP_K] * LAYERS
    for r in range(2):
        metrics = ranks[r][2]["metrics"]
        moved = metrics["pdserve_moe_a2a_bytes_total"], metrics["pdserve_moe_a2a_calls_total"]
        if backend == "gloo":  # one exchange per layer and step
            assert moved[0] > 0 and moved[1] == LAYERS * NEW_TOKENS and metrics["pdserve_moe_a2a_seconds_total"] > 0
        else:
            assert moved == (0, 0)
