"""Preemption on the real model: a KV pool far too small for the batch still finishes every
request, with the same greedy tokens as a roomy pool, and the pool stays consistent."""

from __future__ import annotations

import pytest

from pdserve.engine import Engine

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"Story number {i}: the dragon and the {w}" for i, w in enumerate(
    ["knight", "wizard", "baker", "sailor", "child", "robot", "farmer", "queen"])]
SP = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def test_tiny_pool_preempts_and_matches_roomy_pool():
    # 8 prompts of ~12 tokens growing to ~36: 8 * 3 pages needed, 8 pages (128 tokens) available
    with Engine(rank_on_thread=True, dtype="float32", max_total_tokens=128, num_threads=2, num_reserved_decode_tokens=0) as tiny:
        got = tiny.generate(PROMPTS, SP)
        tiny.check_integrity()
        retractions = tiny.call(lambda: tiny.loop.scheduler.num_retractions)
        roomy_alone = [tiny.generate(p, SP) for p in PROMPTS[:2]]  # one at a time fits
        tiny.check_integrity()
    assert retractions > 0
    for r in got:
        assert r["meta_info"]["completion_tokens"] == 24
        assert r["meta_info"]["finish_reason"]["type"] == "length"
    for alone, batched in zip(roomy_alone, got):
        assert alone["output_ids"] == batched["output_ids"]
    with Engine(rank_on_thread=True, dtype="float32", max_total_tokens=4096, num_threads=2, disable_radix_cache=True) as roomy:
        ref = roomy.generate(PROMPTS, SP)
        roomy.check_integrity()
        assert roomy.stats().num_free_pages == roomy.stats().num_total_pages
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
