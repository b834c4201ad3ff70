"""PD decode write-back: the decode keeps a finished sequence's KV (prompt and output) in its tiered
prefix cache and writes it to the storage tier, so the next turn's prefill loads the previous
answer's KV instead of computing it. Over the in-process PD stand (tests/loop_stand.py: real
loops, KV managers and pools, the ``EchoRunner`` whose decode checks every KV slot it reads)."""

from __future__ import annotations

import json
import time

from loop_stand import PDPair, reference


def hicache(path: str) -> dict:
    return {"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_storage_backend_extra_config": json.dumps({"path": path})}


def test_next_turn_loads_the_previous_answer_written_back_by_the_decode(tmp_path):
    pair = PDPair(p_engine=hicache(str(tmp_path)), d_engine=hicache(str(tmp_path)))
    try:
        turn1 = list(range(1, 11))  # 10 tokens: 2 full pages on the prefill
        pair.submit("t1", turn1, max_new=8)
        pair.run(pair.done("t1"))
        answer = pair.tokens("t1")
        assert answer == reference(turn1, 8)
        d_cache = pair.decode.cache
        deadline = time.monotonic() + 10
        while not d_cache.storage.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        # the decode held prompt + answer but the last token: (10 + 8 - 1) // 4 = 4 full pages
        assert d_cache.storage.stats.put_pages == 4
        turn2 = turn1 + answer + [7, 7, 7]  # 21 tokens: 5 full pages, the last computed anyway
        pair.submit("t2", turn2, max_new=4)
        pair.run(pair.done("t2"))
        assert pair.tokens("t2") == reference(turn2, 4)
        p_cache = pair.prefill.cache
        # pages 1-2 were the prefill's own (turn 1's prompt); 3-4 hold the answer: from the store
        assert p_cache.stats.store_hit_pages == 2
        assert pair.final("P", "t2").cached_tokens == 4 * 4
        pair.settle()
    finally:
        pair.close()
