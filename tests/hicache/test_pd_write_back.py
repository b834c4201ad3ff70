"""PD decode write-back and prefix reuse: the decode keeps a finished sequence's KV (prompt and output) in its tiered
prefix cache and writes it to the storage tier, so the next turn's prefill loads the previous
answer's KV instead of computing it. Over the in-process PD stand (tests/loop_stand.py: real
loops, KV managers and pools, the ``EchoRunner`` whose decode checks every KV slot it reads)."""

from __future__ import annotations

import json
import time

from support.loop_stand import PDPair, reference


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
        while not d_cache.storage.idle() and time.monotonic() < deadline:  # idle: written, not just dequeued
            time.sleep(0.01)
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
        # the prefill's hits reach the response through the room's aux data
        assert pair.final("D", "t2").cached_tokens == 4 * 4
        pair.settle()
    finally:
        pair.close()


def sent_bytes(pair: PDPair) -> float:
    for f in pair.prefill.kv.metrics.snapshot():
        if f.name == "pdserve_kv_transfer_sent_bytes":
            return sum(s.value for s in f.samples if s.name.endswith("_total"))
    raise AssertionError("no sent-bytes family")


def test_the_decode_holds_the_history_and_the_prefill_sends_only_new_pages():
    """The decode's room request says how many leading pages it holds (RoomRequest.held_pages):
    the second turn crosses with only the pages after the previous answer, and decodes correctly
    over the held ones (the EchoRunner reads every slot)."""
    pair = PDPair()
    try:
        page_bytes = pair.prefill.kv.metrics.room_page_bytes
        turn1 = list(range(1, 11))  # 3 pages
        pair.submit("t1", turn1, max_new=8)
        pair.run(pair.done("t1"))
        answer = pair.tokens("t1")
        first = sent_bytes(pair)
        assert first == 3 * page_bytes
        turn2 = turn1 + answer + [7, 7, 7]  # 21 tokens: 6 pages; the decode holds the first 4
        pair.submit("t2", turn2, max_new=4)
        pair.run(pair.done("t2"))
        assert pair.tokens("t2") == reference(turn2, 4)
        assert sent_bytes(pair) - first == 2 * page_bytes
        pair.settle()
    finally:
        pair.close()
