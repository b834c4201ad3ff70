"""Tier-aware ``kv_aware``: the media it reads, the weights as a table, the index per tier, and a
conversation routed back to the decode worker whose cache holds it (the router's PD pairing with
``--decode-policy kv_aware``, fed the events of a real radix cache)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import RadixCache
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.kv.kv_aware_policy import KVAwarePolicy, choose_by_overlap
from pdserve.router.kv.kv_index import KVIndex
from pdserve.router.kv.kv_tiers import Tier, TierWeights, tier_credit, tier_of
from pdserve.router.workers.pairing import Pairing
from pdserve.router.simple_policies import RoundRobinPolicy
from pdserve.router.workers.worker_registry import WorkerRegistry

P, H, D, S = Tier.POOL, Tier.HOST, Tier.DISK, Tier.STORAGE


def test_media_of_vllm_sglang_and_dynamo():
    table = {None: P, "GPU": P, "gpu": P, "DEVICE": P, "CPU": H, "CPU_TIER1": H, "CPU_PINNED": H,
             "DISK": D, "NVME": D, "STORAGE": S, "CPU_TIER2": S, "EXTERNAL": S, "SHARED": S, "tape": None}
    assert {m: tier_of(m) for m in table} == table


@pytest.mark.parametrize("tiers, weights, credit", [
    ([P, P, P], TierWeights(), 3.0),
    ([P, H, H], TierWeights(), 1 + 0.8 * 2),
    ([P, H, S, S], TierWeights(), 1 + 0.8 + 0.5 * 2),
    ([D, S], TierWeights(), 0.5 * 2),  # a worker's disk counts as the store does
    ([S] * 4, TierWeights(storage=0.0), 0.0),
    ([H, H], TierWeights(host=1.0), 2.0),
    ([], TierWeights(), 0.0),
])
def test_tier_credit_table(tiers, weights, credit):
    assert tier_credit(tiers, weights) == pytest.approx(credit)


def test_weights_are_fractions_of_a_pool_block():
    with pytest.raises(ValueError):
        TierWeights(host=1.5)
    with pytest.raises(ValueError):
        RouterConfig(kv_storage_cache_hit_weight=-0.1)
    from pdserve.router.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["--kv-host-cache-hit-weight", "0.9", "--kv-storage-cache-hit-weight", "0.25"]))
    assert (cfg.kv_host_cache_hit_weight, cfg.kv_storage_cache_hit_weight) == (0.9, 0.25)
    assert (RouterConfig().kv_host_cache_hit_weight, RouterConfig().kv_storage_cache_hit_weight) == (0.8, 0.5)


def ev(kind, hashes, medium):
    if kind == "stored":
        return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * len(hashes),
                           block_size=1, lora_id=None, medium=medium)
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def test_index_keeps_each_tier_and_the_shared_store():
    h = block_hashes(list(range(12)), 2)  # 6 chained blocks
    idx = KVIndex(max_store_blocks=5)
    idx.apply("a", [ev("stored", h[:3], "GPU"), ev("stored", h[:4], "CPU")])
    idx.apply("b", [ev("stored", h[:2], "CPU_TIER1"), ev("stored", h, "STORAGE")])
    # the store holds 5 at most: the oldest (h[0]) went, so nobody's store run starts at block 0
    assert not idx.in_store(h[0]) and idx.in_store(h[5])
    assert idx.block_tiers(h, ["a", "b", "c"]) == {"a": [P, P, P, H, S, S], "b": [H, H, S, S, S, S], "c": []}
    idx.apply("b", [ev("stored", h[:1], "STORAGE")])  # stored again: the newest now, h[1] the oldest went
    assert idx.block_tiers(h, ["c"]) == {"c": [S]} and not idx.in_store(h[1]) and idx.in_store(h[2])
    assert idx.overlap(h, ["a", "b"]) == {"a": 3, "b": 0}
    # out of a's pool to host: the host copy still counts, at host weight
    idx.apply("a", [ev("removed", [h[2]], "GPU")])
    assert idx.block_tiers(h, ["a"]) == {"a": [P, P, H, H, S, S]}
    idx.apply("a", [ev("removed", [h[1]], "GPU"), ev("removed", [h[1]], "CPU")])
    assert idx.block_tiers(h, ["a"]) == {"a": [P]}  # h[1] in no tier (nor the store): the run ends
    # a clear (flush, restart) empties a's own tiers only; the store is everyone's
    idx.apply("a", [AllBlocksCleared()])
    assert idx.block_tiers(h[:2], ["a"]) == {"a": [S]} and idx.keys() == ["b"]
    idx.apply("b", [ev("removed", [h[0]], "STORAGE"), ev("stored", h[:1], "TAPE")])
    assert not idx.in_store(h[0]) and idx.unknown_media == 1


class E:
    def __init__(self, key: str, load: int = 0):
        self.key, self.load = key, load


@pytest.mark.parametrize("a, b, load_a, winner", [
    ([P] * 4, [H] * 6, 0, "b"),  # 6 host blocks (4.8) beat 4 pool blocks
    ([P] * 4, [H] * 4, 0, "a"),  # as many blocks: the pool's win
    ([P] * 6 + [S] * 4, [S] * 10, 0, "a"),  # 8 against 5
    ([P] * 6 + [S] * 4, [S] * 10, 1, "b"),  # the store narrows a's lead: one request queued undoes it
    ([P] * 6, [], 1, "a"),  # without the store, a keeps it at that load (4 + 4 < 10)
])
def test_choice_with_tiers(a, b, load_a, winner):
    w = TierWeights()
    eps = [E("a", load_a), E("b")]
    credits = {"a": tier_credit(a, w), "b": tier_credit(b, w)}
    assert choose_by_overlap(eps, credits, 10, 4.0, 1.0, {}).key == winner


@pytest.fixture()
def kv_policy():
    policy = KVAwarePolicy(RouterConfig())  # prompts of token ids: no tokenizer needed
    yield policy
    policy.close()


def test_decode_policy_kv_aware_returns_a_conversation_to_its_decode_worker(kv_policy):
    """Two decode workers; each finished turn leaves prompt and answer in that worker's radix
    cache (as a decode server's release does), whose events reach the index. The next turn of
    each conversation goes back to its worker, until that worker's queue outweighs the reuse."""
    reg = WorkerRegistry(False)
    reg.add(WorkerSpec("http://198.51.100.10:30000", "prefill", 8998), healthy=True)
    d1 = reg.add(WorkerSpec("http://198.51.100.21:30001", "decode"), healthy=True)
    d2 = reg.add(WorkerSpec("http://198.51.100.22:30001", "decode"), healthy=True)
    kv_policy._page_size = 4
    kv_policy._subscribed |= {d1.url, d2.url}  # as if their /server_info named their event endpoints
    pairing = Pairing(reg, RoundRobinPolicy(), kv_policy, random.Random(0))
    caches = {}
    for w in (d1, d2):
        pool = PagePool(64, 4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
        caches[w.url] = (pool, RadixCache(pool))
        caches[w.url][1].enable_events()

    def finish_turn(url: str, tokens: list[int]) -> None:
        pool, cache = caches[url]
        pages, node = cache.match_prefix(tokens)
        cache.lock(node)
        new = pool.alloc(pool.pages_for(len(tokens)) - len(pages))
        cache.insert(tokens, pages + new, len(pages))
        cache.unlock(node)
        kv_policy.index.apply(url, cache.drain_events())

    rng = random.Random(3)
    history = {c: [rng.randrange(1000) for _ in range(40)] for c in ("x", "y")}  # the first prompts
    home = {}
    for c in ("x", "y", "x", "x", "y", "x", "y", "y"):  # not alternating: round robin would miss
        prompt = history[c]
        if c in home:  # its worker's cache holds the whole history, the last answer included
            assert kv_policy.index.overlap(block_hashes(prompt, 4), [home[c]])[home[c]] == (len(prompt) - 16) // 4
        d = pairing.choose({"input_ids": prompt}).decode
        assert d.key == home.setdefault(c, d.key)
        answer = [rng.randrange(1000) for _ in range(12)]
        finish_turn(d.worker.url, prompt + answer)
        history[c] = prompt + answer + [rng.randrange(1000) for _ in range(16)]  # and a new message
    assert home["x"] != home["y"]  # the second conversation found nothing cached: the emptier worker
    # x's worker busy with many requests: its 20-odd cached blocks no longer outweigh the queue
    x_home = next(e for e in reg.healthy_endpoints("decode") if e.key == home["x"])
    x_home.load = 50
    assert pairing.choose({"input_ids": history["x"]}).decode.key == home["y"]
