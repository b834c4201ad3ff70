"""The offline Engine with the host tier on a KV pool too small to keep the prompts: pages that
came back from host memory give the same greedy fp32 output as the hierarchy off."""

from __future__ import annotations

import pytest

from pdserve.engine import Engine

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
# each ~40 tokens; the pool (6 pages of 16) keeps at most two of them at a time
PROMPTS = [
    "Here is a long shared instruction that many requests start with, about the history of the "
    "river and the bridges built over it in the old town, which one must read carefully. Question one:",
    "A completely different preamble that talks about astronomy, the planets of the solar system, "
    "their moons, their rings and how far each is from the sun, in some detail. Question two:",
    "Yet another context: a recipe for bread with flour, water, salt and yeast, kneaded for ten "
    "minutes, left to rise twice, then baked in a hot oven until golden brown. Question three:",
]
SMALL = {"dtype": "float32", "max_total_tokens": 96, "num_threads": 2, "num_reserved_decode_tokens": 8}


def run_rounds(engine: Engine) -> list[list[int]]:
    """Each prompt twice, in turns, so each second visit finds its pages evicted from the pool."""
    outs = []
    for _ in range(2):
        for p in PROMPTS:
            outs.append(engine.generate(p, GREEDY))
            engine.check_integrity()
    return outs


def test_pages_loaded_from_host_give_the_same_greedy_output():
    """write_through (the default); the other policies' copies are the same code (unit tests)."""
    with Engine(**SMALL, rank_on_thread=True) as off:
        base = run_rounds(off)
        full = [(o["meta_info"]["prompt_tokens"] - 1) // 16 * 16 for o in base]
        # the second visits found some of their pages evicted
        assert all(o["meta_info"]["cached_tokens"] < f for o, f in zip(base[3:], full[3:]))
    with Engine(**SMALL, enable_hierarchical_cache=True, hicache_ratio=4.0, rank_on_thread=True) as on:
        tiered = run_rounds(on)
        stats = on.call(lambda: on.loop.cache.stats)
    for b, t in zip(base, tiered):
        assert t["output_ids"] == b["output_ids"]
    for o, f in zip(tiered[3:], full[3:]):  # the second visits: every full page cached, the evicted from host
        assert o["meta_info"]["cached_tokens"] == f > 0
    assert stats.host_hit_pages >= 3
