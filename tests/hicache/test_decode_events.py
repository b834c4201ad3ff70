"""A decode server publishes its cache's KV events as a prefill server does: a finished sequence
(prompt and answer) is stored in its pool, its host memory and the store, and a router's index fed
those events finds the next turn's history on it. Over the in-process PD stand (tests/loop_stand.py)."""

from __future__ import annotations

from loop_stand import PDPair
from test_pd_write_back import hicache

from pdserve.engine.mem_cache.kv_events import BlockStored, block_hashes
from pdserve.router.kv.kv_index import KVIndex
from pdserve.router.kv.kv_tiers import Tier
from test_store_cache import settle


def test_the_decode_publishes_each_finished_sequence_in_every_tier(tmp_path):
    pair = PDPair(p_engine=hicache(str(tmp_path)), d_engine=hicache(str(tmp_path)))
    try:
        d_cache = pair.decode.cache
        d_cache.enable_events()  # what --kv-events-config does on a decode server's rank
        turn1 = list(range(1, 11))
        pair.submit("t1", turn1, max_new=8)
        pair.run(pair.done("t1"))
        answer = pair.tokens("t1")
        events = d_cache.drain_events()
        stored: dict[str, list[int]] = {}
        for ev in events:
            assert isinstance(ev, BlockStored)
            stored.setdefault(ev.medium, []).extend(ev.block_hashes)
        # the decode holds prompt + answer but the last token: 4 full pages, in each tier
        held = block_hashes((turn1 + answer)[:16], 4)
        assert stored == {"GPU": held, "CPU": held, "STORAGE": held}
        index = KVIndex()
        index.apply("D", events)
        turn2 = turn1 + answer + [7, 7, 7]
        assert index.block_tiers(block_hashes(turn2, 4), ["D"]) == {"D": [Tier.POOL] * 4}
        settle(d_cache)
        pair.settle()
    finally:
        pair.close()
