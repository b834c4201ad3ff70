"""The latent KV pool (multi-head latent attention): one vector per token per layer, K buffers only,
and everything that walks a pool's K and V (host tier, store objects, KV ops, sizing) takes it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.page_pool import LATENT, MHA, PagePool
from pdserve.kernels.kv_ops import gather_slots, store_kv

LAYERS, PAGE, LATENT_DIM = 3, 4, 576


def latent_pool(num_pages: int = 8) -> PagePool:
    return PagePool(num_pages, PAGE, LAYERS, 1, LATENT_DIM, torch.float32, kind=LATENT)


def test_latent_pool_has_k_buffers_only():
    pool = latent_pool()
    assert pool.v == [] and len(pool.k) == LAYERS
    assert pool.k[0].shape == (1, 8, PAGE, LATENT_DIM)
    infos = pool.buffer_infos()
    assert len(infos) == LAYERS
    assert [i.base_addr for i in infos] == [t.data_ptr() for t in pool.k]
    lay = pool.layout()
    assert lay.kind == LATENT and lay.planes == 1 and lay.num_kv_heads == 1 and lay.head_dim == LATENT_DIM
    with pytest.raises(ValueError, match="no V buffers"):
        pool.v_slots(0)


def test_latent_pool_refuses_several_heads_and_unknown_kinds():
    with pytest.raises(ValueError, match="num_kv_heads 1"):
        PagePool(4, PAGE, LAYERS, 2, LATENT_DIM, torch.float32, kind=LATENT)
    with pytest.raises(ValueError, match="kind must be one of"):
        PagePool(4, PAGE, LAYERS, 1, LATENT_DIM, torch.float32, kind="mqa")


def test_bytes_per_token_counts_one_vector_per_layer():
    latent = PagePool.bytes_per_token(LAYERS, 1, LATENT_DIM, torch.bfloat16, LATENT)
    assert latent == LAYERS * LATENT_DIM * 2
    assert PagePool.bytes_per_token(LAYERS, 1, LATENT_DIM, torch.bfloat16, MHA) == 2 * latent


def test_store_gather_and_move_slots_over_latent():
    pool = latent_pool()
    slots = torch.tensor([4, 5, 9], dtype=torch.int64)
    x = torch.randn(3, 1, LATENT_DIM)
    store_kv(pool.k[1], None, slots, x, None)
    assert torch.equal(gather_slots(pool.k[1], slots), x)
    pool.move_slots([4, 5], [12, 13])
    assert torch.equal(gather_slots(pool.k[1], torch.tensor([12, 13])), x[:2])
    assert pool.release_memory() > 0
    pool.resume_memory()
    assert not pool.k[1].any()


def test_host_tier_round_trips_latent_pages():
    pool = latent_pool()
    pages = pool.alloc(2)
    for layer in range(LAYERS):
        pool.k[layer][:, pages] = torch.randn(1, 2, PAGE, LATENT_DIM)
    expect = [pool.k[layer][:, pages].clone() for layer in range(LAYERS)]
    host = HostKVPool(pool, 4)
    assert host.slot_bytes == LAYERS * PAGE * LATENT_DIM * 4  # one plane, not K and V
    slots = host.alloc(2)
    host.write(pool, pages, slots)
    view = host.slot_bytes_view(slots[0])
    assert view.numel() == host.slot_bytes
    back = pool.alloc(2)
    host.read(pool, slots, back)
    for layer in range(LAYERS):
        assert torch.equal(pool.k[layer][:, back], expect[layer])
    host.free(slots)
    pool.free(pages + back)
    pool.check_integrity()
    host.check_integrity()
    assert HostKVPool.slots_for(pool, 0.0, 1.0) == 2**30 // host.slot_bytes
