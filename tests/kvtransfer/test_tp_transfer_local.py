"""KV managers of different TP sizes in one process over the ``local`` backend: each prefill TP rank's
heads land in the right heads of the right decode TP rank's pages, and every decode rank gets the aux.

(Whole TP loops in one process are not possible: a process has one ``torch.distributed`` group, so the
loops' agreement runs in ``tests/tp``, over real processes.)"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer import AuxData, BootstrapServer, DecodeKVManager, KVPoll, KVTransferConfig, PrefillKVManager
from pdserve.kvtransfer.head_slices import TPPlace, kv_head_range

pytestmark = pytest.mark.timeout(60)

LAYERS, PAGE, HEAD_DIM, PAGES = 2, 4, 8, 16


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.parametrize("p_tp,d_tp,kv_heads", [(2, 1, 2), (1, 2, 2), (2, 2, 4), (1, 4, 2), (4, 1, 2)])
def test_every_decode_rank_gets_its_heads_and_the_aux(p_tp, d_tp, kv_heads):
    server = BootstrapServer("127.0.0.1", 0, tp_size=p_tp).start_in_thread()
    cfg = KVTransferConfig(backend="local", bootstrap_port=server.port, num_transfer_threads=1, aux_num_slots=4)

    def pool(tp: int, rank: int) -> PagePool:
        return PagePool(PAGES, PAGE, LAYERS, len(kv_head_range(rank, tp, kv_heads)), HEAD_DIM, torch.float32)

    p_pools = [pool(p_tp, i) for i in range(p_tp)]
    d_pools = [pool(d_tp, j) for j in range(d_tp)]
    # every source element says which global head it is: 100 * head + a per-token value
    for i, p in enumerate(p_pools):
        heads = kv_head_range(i, p_tp, kv_heads)
        for t in (*p.k, *p.v):  # head-major: [heads, pages, page_size, dim]
            for local, h in enumerate(heads):
                t[local] = 100 * h + torch.arange(PAGES * PAGE, dtype=torch.float32).view(PAGES, PAGE, 1)
    prefills = [PrefillKVManager(cfg, p, tp=TPPlace(i, p_tp, kv_heads)).start() for i, p in enumerate(p_pools)]
    decodes = [DecodeKVManager(cfg, d, tp=TPPlace(j, d_tp, kv_heads)).start() for j, d in enumerate(d_pools)]
    try:
        room, src_pages, dst_pages = 77, [1, 2, 3, 7], [5, 6, 9, 10]
        senders = [m.create_sender(room) for m in prefills]
        receivers = [m.create_receiver(room, "127.0.0.1", server.port, 0) for m in decodes]
        _wait(lambda: all(r.poll() is KVPoll.WaitingForInput for r in receivers), "decode ranks bootstrapped")
        slots = [m.aux_pool.alloc() for m in decodes]
        for r, slot in zip(receivers, slots):
            r.init(dst_pages, slot)
        _wait(lambda: all(s.poll() is KVPoll.WaitingForInput for s in senders), "every prefill rank has its destinations")
        for s in senders:
            s.send(src_pages, True, AuxData(42, -0.25, [42, 7], [-0.25, -3.0]))
        _wait(lambda: all(r.poll().done for r in receivers), "rooms done")
        assert [r.poll() for r in receivers] == [KVPoll.Success] * d_tp, [r.failure_reason for r in receivers]
        for j, (d, r) in enumerate(zip(d_pools, receivers)):
            assert r.aux().token_id == 42 and r.aux().top_ids == [42, 7]
            heads = kv_head_range(j, d_tp, kv_heads)
            for t in (*d.k, *d.v):
                for local, h in enumerate(heads):
                    want = (100 * h + torch.arange(PAGES * PAGE, dtype=torch.float32).view(PAGES, PAGE, 1))[src_pages]
                    assert torch.equal(t[local, dst_pages], want.expand(-1, -1, HEAD_DIM)), (j, h)
                assert not t[:, [0, 1, 2, 3, 4]].any()  # nothing else written
        _wait(lambda: all(s.poll() is KVPoll.Success for s in senders), "senders done")
    finally:
        for m in prefills + decodes:
            m.close()
        server.stop_thread()
