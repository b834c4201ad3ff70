"""Latent (MLA) KV pools through the transfer layer, over the real engines on loopback: at any pair of
TP sizes every decode rank receives the whole latent page runs from exactly one prefill rank, the bytes
a room moves are the latent pages' size (one vector per token per layer, no V), no destination byte is
written twice, and a latent pool never pairs with a per-head one."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer import AuxData, BootstrapServer, DecodeKVManager, KVPoll, KVTransferConfig, PrefillKVManager
from pdserve.kvtransfer.head_slices import TPPlace, head_slices, place_for
from pdserve.kvtransfer.engines.transfer_engine import create_transfer_engine

pytestmark = pytest.mark.timeout(120)

LAYERS, PAGE, LATENT, PAGES = 3, 4, 24, 16  # LATENT: kv_lora_rank + qk_rope_head_dim of a tiny model
MODEL_HEADS = 4  # the model's attention heads: the latent ignores them


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


class WriteLog:
    """Wraps a real engine's ``write`` (what the transfer threads call): every (dst address, length)."""

    def __init__(self, engine):
        self.writes: list[tuple[int, int]] = []
        inner = engine.write

        def write(peer, src, dst, lengths, notify=None):
            self.writes.extend(zip(dst, lengths))
            return inner(peer, src, dst, lengths, notify)

        engine.write = write

    def into(self, pool: PagePool) -> list[tuple[int, int]]:
        """The writes that landed in ``pool``'s KV buffers (not the aux slots)."""
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (*pool.k, *pool.v)]
        return [(a, n) for a, n in self.writes if any(lo <= a < hi for lo, hi in spans)]


def test_latent_place_is_one_head_every_rank_holds():
    for p_tp, d_tp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]:
        kv_heads = place_for(TPPlace(0, p_tp, MODEL_HEADS), "latent").kv_heads
        slices = head_slices(p_tp, d_tp, kv_heads)
        assert [s.dst_rank for s in slices] == list(range(d_tp))  # one source per decode rank
        assert all(s.num_heads == 1 and s.src_head == s.dst_head == 0 and s.aux for s in slices)
    assert place_for(TPPlace(0, 2, MODEL_HEADS), "mha").kv_heads == MODEL_HEADS


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_latent_room_moves_the_latent_pages_once(backend, p_tp, d_tp):
    server = BootstrapServer("127.0.0.1", 0, tp_size=p_tp).start_in_thread()
    cfg = KVTransferConfig(backend=backend, host="127.0.0.1", bootstrap_port=server.port, num_transfer_threads=1,
                           aux_num_slots=4)
    p_pools = [PagePool(PAGES, PAGE, LAYERS, 1, LATENT, torch.float32, kind="latent") for _ in range(p_tp)]
    d_pools = [PagePool(PAGES, PAGE, LAYERS, 1, LATENT, torch.float32, kind="latent") for _ in range(d_tp)]
    assert all(p.v == [] for p in p_pools + d_pools)
    # the latent is identical on every TP rank: each element says its layer and token slot
    for p in p_pools:
        for layer, t in enumerate(p.k):
            t[0] = 1000 * (layer + 1) + torch.arange(PAGES * PAGE, dtype=torch.float32).view(PAGES, PAGE, 1)
    engines = [create_transfer_engine(backend, "127.0.0.1") for _ in range(p_tp)]
    logs = [WriteLog(e) for e in engines]
    prefills = [PrefillKVManager(cfg, p, tp=TPPlace(i, p_tp, MODEL_HEADS), engine=e).start()
                for i, (p, e) in enumerate(zip(p_pools, engines))]
    decodes = [DecodeKVManager(cfg, d, tp=TPPlace(j, d_tp, MODEL_HEADS)).start() for j, d in enumerate(d_pools)]
    try:
        room, src_pages, dst_pages = 9, [1, 2, 3, 7, 8], [5, 6, 9, 10, 11]
        senders = [m.create_sender(room) for m in prefills]
        receivers = [m.create_receiver(room, "127.0.0.1", server.port, 0) for m in decodes]
        _wait(lambda: all(r.poll() is KVPoll.WaitingForInput for r in receivers), "decode ranks bootstrapped")
        for r, m in zip(receivers, decodes):
            r.init(dst_pages, m.aux_pool.alloc())
        _wait(lambda: all(s.poll() is KVPoll.WaitingForInput for s in senders), "every prefill rank is ready")
        for s in senders:
            s.send(src_pages, True, AuxData(11, -0.5, [11], [-0.5]))
        _wait(lambda: all(r.poll().done for r in receivers), "rooms done")
        assert [r.poll() for r in receivers] == [KVPoll.Success] * d_tp, [r.failure_reason for r in receivers]
        _wait(lambda: all(s.poll() is KVPoll.Success for s in senders), "senders done")

        latent_page_bytes = PAGE * LATENT * 4  # one vector per token, fp32, one layer
        room_bytes = len(dst_pages) * LAYERS * latent_page_bytes
        for j, d in enumerate(d_pools):
            written = [w for log in logs for w in log.into(d)]
            # the room's bytes are the latent pages' size, and no byte was written twice
            assert sum(n for _, n in written) == room_bytes, (j, written)
            ranges = sorted((a, a + n) for a, n in written)
            assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:])), "a destination byte written twice"
            # exactly one prefill rank wrote into each decode rank
            assert sum(1 for log in logs if log.into(d)) == 1
            assert receivers[j].aux().token_id == 11
            for layer, t in enumerate(d.k):
                want = (1000 * (layer + 1) + torch.arange(PAGES * PAGE, dtype=torch.float32).view(PAGES, PAGE, 1))
                assert torch.equal(t[0, dst_pages], want[src_pages].expand(-1, -1, LATENT)), (j, layer)
                assert not t[0, [0, 1, 2, 3, 4]].any()  # nothing else written
        # on the wire: the room once per decode rank, all of it latent pages
        sent = [sum(n for d in d_pools for _, n in log.into(d)) for log in logs]
        assert sum(sent) == d_tp * room_bytes
        assert [p.metrics.bytes._value.get() for p in prefills] == sent
    finally:
        for m in prefills + decodes:
            m.close()
        server.stop_thread()


@pytest.mark.parametrize("prefill_latent", [True, False])
def test_latent_and_per_head_pools_refuse_to_pair(prefill_latent):
    server = BootstrapServer("127.0.0.1", 0, tp_size=1).start_in_thread()
    cfg = KVTransferConfig(backend="local", bootstrap_port=server.port, num_transfer_threads=1, aux_num_slots=4)
    latent = PagePool(PAGES, PAGE, LAYERS, 1, LATENT, torch.float32, kind="latent")
    mha = PagePool(PAGES, PAGE, LAYERS, 1, LATENT, torch.float32)
    p_pool, d_pool = (latent, mha) if prefill_latent else (mha, latent)
    prefill = PrefillKVManager(cfg, p_pool).start()
    decode = DecodeKVManager(cfg, d_pool).start()
    try:
        prefill.create_sender(3)
        receiver = decode.create_receiver(3, "127.0.0.1", server.port, 0)
        _wait(lambda: receiver.poll() is KVPoll.Failed, "the pair refused")
        reason = receiver.failure_reason
        p_kind, d_kind = ("latent", "mha") if prefill_latent else ("mha", "latent")
        assert f"prefill {p_kind} 1x{LATENT} float32" in reason and f"decode {d_kind} 1x{LATENT} float32" in reason, reason
        assert decode.pool.num_used == 0 and prefill.pool.num_used == 0
    finally:
        prefill.close()
        decode.close()
        server.stop_thread()
