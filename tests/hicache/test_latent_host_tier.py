"""A latent (MLA) pool in the host tier and the store's namespace: its K-only pages round-trip through
the host slots at their own size, and its namespace is the same at every TP rank and differs from a
per-head pool's of the same width."""

from __future__ import annotations

import torch

from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.storage_key import kv_namespace

LAYERS, PAGE, LATENT = 2, 4, 12


def test_latent_pages_round_trip_through_the_host_tier():
    pool = PagePool(6, PAGE, LAYERS, 1, LATENT, torch.float32, kind="latent")
    host = HostKVPool(pool, 4)
    assert host.slot_bytes == LAYERS * PAGE * LATENT * 4  # K only, one vector per token
    for layer, t in enumerate(pool.k):
        t[0, 1:3] = torch.randn(2, PAGE, LATENT)
    want = [t[0, 1:3].clone() for t in pool.k]
    slots = host.alloc(2)
    host.write(pool, [1, 2], slots)
    host.read(pool, slots, [4, 5])
    assert all(torch.equal(t[0, 4:6], w) for t, w in zip(pool.k, want))
    host.free(slots)
    host.check_integrity()
    assert HostKVPool.slots_for(pool, 1.0, 1e-6) == int(1e-6 * 2**30) // host.slot_bytes


def test_latent_namespace_is_shared_by_every_tp_rank():
    latent = PagePool(6, PAGE, LAYERS, 1, LATENT, torch.float32, kind="latent").layout()
    mha = PagePool(6, PAGE, LAYERS, 1, LATENT, torch.float32).layout()
    assert kv_namespace("/m", latent, 0) == kv_namespace("/m", latent, 3)
    assert kv_namespace("/m", mha, 0) != kv_namespace("/m", mha, 1)
    assert kv_namespace("/m", latent, 0) != kv_namespace("/m", mha, 0)
