"""Expert placement under EP 2 (two gloo ranks, the tiny random Qwen3-MoE: 8 experts, top 3):
fp32 greedy gives exactly transformers' tokens with R = 2 redundant expert slots whose placement
EPLB recomputes mid-generation (every 3 steps, weights moved between the ranks by gloo), and with
a placement read from an ``--init-expert-location`` file. The expert recorder counts on across
the rebalances: tokens x top_k per layer over the group, by logical expert.

Each run starts real processes joined by gloo (``tp_harness``); transformers runs in this process.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from support.model_util import hf_greedy, hf_model
from tp_harness import run_tp

from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.messages import RankMetrics
from pdserve.engine.model_executor.layers.ep_placement import trivial_placement

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(3, 40)), [1] + [17, 250, 3] * 9]
NEW_TOKENS = 10
TOP_K, EXPERTS, LAYERS, REDUNDANT = 3, 8, 3, 2
EVERY = 3  # rebalances before steps 4, 7 and 10


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoints):
    model = hf_model(tiny_checkpoints["qwen3_moe"])
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def _check(got, got_logits, ranks, hf_reference):
    assert got == [r[0] for r in hf_reference]
    for a, ref in zip(got_logits, hf_reference):
        np.testing.assert_allclose(a, ref[1].numpy(), atol=1e-4, rtol=0)
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NEW_TOKENS - 1)
    dump = np.array(ranks[0][2]["dump"])
    assert dump.shape == (LAYERS, EXPERTS) and dump.sum(axis=1).tolist() == [tokens * TOP_K] * LAYERS
    assert ranks[0][2]["placement"] == ranks[1][2]["placement"]  # both ranks placed alike


def test_redundant_experts_greedy_identical_across_rebalances(tiny_checkpoints, hf_reference):
    got, got_logits, ranks = run_tp(tiny_checkpoints["qwen3_moe"], 2, PROMPTS, NEW_TOKENS, timeout=540.0,
                                    record_experts=True, ep_size=2, moe_a2a_backend="gloo",
                                    ep_num_redundant_experts=REDUNDANT, enable_eplb=True,
                                    eplb_rebalance_num_iterations=EVERY)
    _check(got, got_logits, ranks, hf_reference)
    rebalances, moved = ranks[0][2]["eplb"]
    assert rebalances == (NEW_TOKENS - 1) // EVERY and moved > 0 and ranks[1][2]["eplb"] == [rebalances, moved]
    _check_eplb_metrics(ranks, rebalances, moved)
    trivial = list(trivial_placement(EXPERTS, REDUNDANT, 2).physical_to_logical)
    placements = ranks[0][2]["placement"]
    assert len(placements) == LAYERS and any(p != trivial for p in placements.values())
    for p in placements.values():
        assert len(p) == EXPERTS + REDUNDANT and set(p) == set(range(EXPERTS))


def _check_eplb_metrics(ranks, rebalances: int, moved: int) -> None:
    """/metrics of the two ranks: the counters say what the balancer did, and each MoE layer's
    imbalance at the last rebalance is the same on both (one all-reduced count) and in range."""
    for r in (0, 1):
        m = ranks[r][2]["metrics"]
        assert m["pdserve_eplb_rebalances_total"] == rebalances and m["pdserve_eplb_moved_experts_total"] == moved
    text = ServerMetrics(1, "m").render([None], [0], {(0, r): RankMetrics(0, r, ranks[r][2]["families"])
                                                        for r in (0, 1)})
    assert f'pdserve_eplb_rebalances_total{{model_name="m",dp_rank="0",tp_rank="1"}} {float(rebalances)}' in text
    for name, most in (("pdserve_eplb_expert_load_imbalance", EXPERTS), ("pdserve_eplb_rank_load_imbalance", 2)):
        values = {}
        for r in (0, 1):
            for layer in range(LAYERS):
                found = re.search(rf'{name}{{model_name="m",dp_rank="0",tp_rank="{r}",layer="{layer}"}} (\S+)', text)
                assert found, (name, r, layer, text)
                values[(r, layer)] = float(found.group(1))
        assert all(1.0 <= v <= most for v in values.values()), values
        assert [values[(0, i)] for i in range(LAYERS)] == [values[(1, i)] for i in range(LAYERS)]


def test_placement_file_greedy_identical(tiny_checkpoints, hf_reference, tmp_path):
    # rank 0 holds experts 7..3 and rank 1 experts 2..0 with replicas of 7 and 6 (each on the other rank)
    row = [7, 6, 5, 4, 3, 2, 1, 0, 7, 6]
    path = tmp_path / "location.json"
    path.write_text(json.dumps({"physical_to_logical_map": [row] * LAYERS}))
    got, got_logits, ranks = run_tp(tiny_checkpoints["qwen3_moe"], 2, PROMPTS, NEW_TOKENS, timeout=540.0,
                                    record_experts=True, ep_size=2, moe_a2a_backend="none",
                                    ep_num_redundant_experts=REDUNDANT, init_expert_location=str(path))
    _check(got, got_logits, ranks, hf_reference)
    assert all(p == row for p in ranks[0][2]["placement"].values())
    own = [np.array(ranks[r][2]["own"]) for r in range(2)]
    assert own[0][:, [0, 1]].sum() == 0 and own[1][:, [3, 4, 5]].sum() == 0  # each counts what it holds
    assert (own[0] + own[1] == np.array(ranks[0][2]["dump"])).all()
