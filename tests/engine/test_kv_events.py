"""KV events of the radix cache: a subscriber replaying them rebuilds the tree exactly, and the
wire layout is vLLM's (checked against msgpack bytes written out by hand)."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import torch

from pdserve.engine.kv_events_config import KVEventsConfig, advertised_endpoints, rank_endpoint
from pdserve.engine.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hashes,
    decode_batch,
    encode_batch,
)
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import RadixCache

PS = 4


class Mirror:
    """A subscriber's copy of one rank's cache: hash -> (parent hash, the block's tokens)."""

    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, ev) -> None:
        if isinstance(ev, BlockStored):
            assert ev.parent_block_hash is None or ev.parent_block_hash in self.blocks
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                assert h not in self.blocks, "stored twice without a removal"
                self.blocks[h] = (parent, tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]))
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in self.blocks, "removed a block never stored"
                assert all(p != h for p, _ in self.blocks.values()), "removed a block with children"
                del self.blocks[h]
        else:
            assert isinstance(ev, AllBlocksCleared)
            self.blocks.clear()


def tree_blocks(cache: RadixCache) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    out, stack = {}, list(cache.root.children.values())
    while stack:
        n = stack.pop()
        out[n.hash] = (n.parent.hash, n.key)
        stack.extend(n.children.values())
    return out


def put(cache, pool, tokens):
    """A finished request: its pages handed to the cache (as the scheduler's release does)."""
    pages, node = cache.match_prefix(tokens)
    cache.lock(node)
    need = pool.pages_for(len(tokens)) - len(pages)
    if pool.num_free < need:
        cache.evict(need - pool.num_free)
    new = pool.alloc(need)
    cache.insert(tokens, pages + new, len(pages))
    cache.unlock(node)


def test_random_workload_events_rebuild_the_tree_exactly():
    rng = random.Random(7)
    pool = PagePool(40, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool)
    cache.enable_events()
    mirror = Mirror()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 17))] for _ in range(5)]
    kinds = set()
    for step in range(400):
        r = rng.random()
        if r < 0.7:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 13))]
            put(cache, pool, tokens)
        elif r < 0.95:
            cache.evict(rng.randrange(1, 6))
        else:
            cache.flush()
        # drained in batches of a few steps, as the scheduler process does once per iteration
        if step % 3 == 0:
            batch = decode_batch(encode_batch(KVEventBatch(ts=0.0, events=cache.drain_events())))
            for ev in batch.events:
                kinds.add(type(ev))
                mirror.apply(ev)
            assert mirror.blocks == tree_blocks(cache)
        cache.check_integrity()
        pool.check_integrity()
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    # the router computes the same chained hashes from a prompt's tokens
    tokens = prefixes[0] + [1, 2, 3, 4]
    put(cache, pool, tokens)
    node_hashes = [n.hash for n in _path(cache, tokens)]
    assert node_hashes == block_hashes(tokens, PS)


def _path(cache, tokens):
    node, out = cache.root, []
    for i in range(len(tokens) // PS):
        node = node.children[tuple(tokens[i * PS : (i + 1) * PS])]
        out.append(node)
    return out


def test_no_events_unless_enabled_and_flush_clears():
    pool = PagePool(9, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool)
    put(cache, pool, list(range(9)))
    assert cache.drain_events() == []
    cache.enable_events()
    put(cache, pool, list(range(8)) + [7, 7, 7, 7])
    (stored,) = cache.drain_events()
    assert stored.block_hashes == block_hashes(list(range(8)) + [7, 7, 7, 7], PS)[2:]
    assert stored.parent_block_hash == block_hashes(list(range(8)), PS)[-1]
    cache.flush()
    assert cache.drain_events() == [AllBlocksCleared()]


# vLLM's consumer types (vllm/distributed/kv_events.py), as a consumer outside pdserve declares them
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemovedV(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksClearedV(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


class _KVEventBatchV(_EventBatch):
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]


def test_wire_layout_is_vllms():
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[10, 11, 12, 13], block_size=2,
                        lora_id=None, medium="GPU"),
            BlockRemoved(block_hashes=[1], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    expected = (
        b"\x93"  # [ts, events, data_parallel_rank]
        + b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"  # 1.5 as float64
        + b"\x93"  # three events
        + b"\x97\xabBlockStored" + b"\x92\x01\x02" + b"\xc0" + b"\x94\x0a\x0b\x0c\x0d" + b"\x02" + b"\xc0"
        + b"\xa3GPU"
        + b"\x93\xacBlockRemoved" + b"\x91\x01" + b"\xa3GPU"
        + b"\x91\xb0AllBlocksCleared"
        + b"\x03"
    )
    assert encode_batch(batch) == expected
    theirs = msgspec.msgpack.decode(expected, type=_KVEventBatchV)
    assert theirs.data_parallel_rank == 3
    assert theirs.events[0] == BlockStoredV([1, 2], None, [10, 11, 12, 13], 2, None, "GPU")
    assert theirs.events[1] == BlockRemovedV([1], "GPU") and theirs.events[2] == AllBlocksClearedV()
    assert decode_batch(expected) == batch


def test_config_json_and_rank_endpoints():
    cfg = KVEventsConfig.from_json('{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv",'
                                   ' "replay_endpoint": "tcp://*:5600"}')
    assert rank_endpoint(cfg.endpoint, 2) == "tcp://*:5559"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    (r0, r1) = advertised_endpoints(cfg, 2, "198.51.100.7")
    assert r1 == {"dp_rank": 1, "endpoint": "tcp://198.51.100.7:5558", "replay_endpoint": "tcp://198.51.100.7:5601",
                  "topic": "kv"}
    assert advertised_endpoints(KVEventsConfig(), 2, "h") == []
    for bad in ('{"publisher": "kafka"}', '{"endpont": "tcp://*:1"}', "[1]", "{"):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
