"""The prefill data plane (``kv_writer``) on its own: real bytes between two pools over the ``local``
engine, a real ZMQ socket for the room's status, and what it reports to the room state machine."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

import pdserve.kvtransfer.messages as m
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer.aux_pool import MAX_TOP_LOGPROBS, AuxData, AuxPool
from pdserve.kvtransfer.decode_peers import DecodePeer
from pdserve.kvtransfer.head_slices import slices_from
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.kv_writer import Chunk, KVWriter, SourcePool, chunk_descriptors, layer_descriptors
from pdserve.kvtransfer.layer_signal import LayerSignal
from pdserve.kvtransfer.engines.local_engine import LocalTransferEngine
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.room_notification import parse_room_notification, room_notification
from pdserve.kvtransfer.sender_rooms import Dest

pytestmark = pytest.mark.timeout(30)

LAYERS, PAGE, HEADS, DIM = 2, 4, 2, 8


class Outcome:
    """The writer's reports, as the room state machine would get them."""

    def __init__(self):
        self.failed: list[str] = []
        self.written: list[int] = []
        self.chunks_done = threading.Semaphore(0)

    def write_failed(self, sender: KVSender, reason: str) -> None:
        self.failed.append(reason)
        sender.state = KVPoll.Failed

    def room_written(self, sender: KVSender) -> bool:
        self.written.append(sender.room)
        return True

    def chunk_done(self, sender: KVSender) -> None:
        self.chunks_done.release()


class Stand:
    def __init__(self):
        self.src_pool = PagePool(8, PAGE, LAYERS, HEADS, DIM, torch.float32)
        self.dst_pool = PagePool(16, PAGE, LAYERS, HEADS, DIM, torch.float32)
        for t in (*self.src_pool.k, *self.src_pool.v):
            t.copy_(torch.randn_like(t))
        self.src_engine, self.dst_engine = LocalTransferEngine("127.0.0.1"), LocalTransferEngine("127.0.0.1")
        src_infos, dst_infos = self.src_pool.buffer_infos(), self.dst_pool.buffer_infos()
        for b in src_infos:
            self.src_engine.register(b.base_addr, b.nbytes)
        for b in dst_infos:
            self.dst_engine.register(b.base_addr, b.nbytes)
        self.dst_aux = AuxPool(4)
        self.dst_engine.register(self.dst_aux.base_addr, self.dst_aux.nbytes)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        reg = m.RegisterPool("d0", f"127.0.0.1:{port}", "local", self.dst_engine.peer_info(),
                             m.LayoutInfo.from_layout(self.dst_pool.layout()), 16, dst_infos[0].page_bytes,
                             [b.base_addr for b in dst_infos[:LAYERS]], [b.base_addr for b in dst_infos[LAYERS:]],
                             self.dst_aux.base_addr, self.dst_aux.slot_bytes, self.dst_aux.num_slots)
        self.peer = DecodePeer(reg, self.src_engine.connect(self.dst_engine.peer_info()), None,
                               [b.base_addr for b in dst_infos])
        self.src = SourcePool([b.base_addr for b in src_infos], src_infos[0].head_page_bytes,
                              src_infos[0].plane_bytes, LAYERS)
        self.outcome, self.stop = Outcome(), threading.Event()
        self.writer = KVWriter(self.src_engine, self.src, 1, MAX_TOP_LOGPROBS, 0, RoomMetrics("prefill", 1024), self.outcome,
                               self.ctx, lambda msg, _endpoint: m.encode(msg), self.stop)
        self.src_engine.register(self.writer.staging.base_addr, self.writer.staging.nbytes)
        self.writer.start()

    def sender(self, room: int, dst_pages: list[int]) -> KVSender:
        s = KVSender(None, room, 0.0)  # no manager: the test hands chunks to the writer itself
        s.state = KVPoll.Transferring
        s.sent_at.append(0.0)
        s.dests[0] = Dest(self.peer, m.RoomRequest(room, "d0", dst_pages, 2), slices_from(0, 1, 1, HEADS))
        return s

    def wait_chunk(self) -> None:
        assert self.outcome.chunks_done.acquire(timeout=10), "the transfer thread did not finish the chunk"

    def landed(self, src_pages: list[int], dst_pages: list[int]) -> bool:
        return all(torch.equal(d[:, dst_pages], s[:, src_pages])
                   for s, d in zip((*self.src_pool.k, *self.src_pool.v), (*self.dst_pool.k, *self.dst_pool.v)))

    def close(self) -> None:
        self.stop.set()
        self.writer.close()
        self.pull.close(0)
        self.ctx.term()
        self.src_engine.close()
        self.dst_engine.close()


@pytest.fixture
def stand():
    st = Stand()
    yield st
    st.close()


def test_room_notifications_round_trip():
    assert parse_room_notification(room_notification(12345, 3)) == (12345, 3)
    for bad in (b"", b"pdserve-room:x:1", b"other:1:2", b"pdserve-room:1"):
        assert parse_room_notification(bad) is None


def test_layer_descriptors_are_the_chunks_cut_by_layer(stand):
    s = stand.sender(1, [5, 6, 9])
    chunk = Chunk(s, [1, 2, 4], 0, 3, False, None)
    src, dst, lengths = chunk_descriptors(stand.src, chunk, s.dests[0])
    per_layer = layer_descriptors(stand.src, chunk, s.dests[0])
    assert len(per_layer) == LAYERS
    assert sorted(zip(src, dst, lengths)) == sorted(t for d in per_layer for t in zip(*d))
    assert len(src) == 2 * LAYERS * HEADS * 2  # two runs ([1,2]->[5,6], [4]->[9]) per head per buffer


def test_chunks_land_then_the_last_brings_aux_status_and_notification(stand):
    dst_pages = [5, 6, 9]
    s = stand.sender(7, dst_pages)
    stand.writer.submit(Chunk(s, [1, 2], 0, 2, False, None))
    stand.wait_chunk()
    assert stand.landed([1, 2], [5, 6]) and stand.outcome.written == []
    stand.writer.submit(Chunk(s, [4], 2, 3, True, AuxData(42, -0.5, [42, 7], [-0.5, -2.0])))
    stand.wait_chunk()
    assert stand.landed([1, 2, 4], dst_pages) and stand.outcome.written == [7]
    assert stand.dst_aux.read(2) == AuxData(42, -0.5, [42, 7], [-0.5, -2.0])
    assert stand.pull.poll(5000), "no RoomStatus"
    status = m.decode(stand.pull.recv())
    assert (status.room, status.success, status.notified, status.tp_rank) == (7, True, True, 0)
    assert stand.dst_engine.get_notifications() == [room_notification(7, 0)]
    assert stand.outcome.failed == [] and s.bytes_sent == 3 * 2 * LAYERS * HEADS * PAGE * DIM * 4


def test_a_layer_wise_chunk_is_written_as_its_forward_stores_layers(stand):
    s = stand.sender(8, [3, 4])
    signal = LayerSignal(LAYERS, torch.device("cpu"))
    stand.writer.submit(Chunk(s, [1, 2], 0, 2, False, None, signal))
    with signal as layer_done:
        layer_done(0)
        layer_done(1)
    stand.wait_chunk()
    assert stand.landed([1, 2], [3, 4]) and stand.outcome.failed == []
    s2 = stand.sender(9, [5, 6])
    half = LayerSignal(LAYERS, torch.device("cpu"))
    stand.writer.submit(Chunk(s2, [1, 2], 0, 2, False, None, half))
    with pytest.raises(RuntimeError), half as layer_done:
        layer_done(0)
        raise RuntimeError("the forward raised after layer 0")
    stand.wait_chunk()
    assert stand.outcome.failed == ["prefill forward of room 9 ended after 1 of 2 layers"]


def test_a_failed_write_is_reported_and_the_chunk_still_ends(stand):
    s = stand.sender(10, [5])
    stand.dst_engine.close()  # the decode rank's engine is gone
    stand.writer.submit(Chunk(s, [1], 0, 1, True, None))
    stand.wait_chunk()
    assert len(stand.outcome.failed) == 1 and stand.outcome.failed[0].startswith("KV write of room 10 failed")
    assert stand.outcome.written == []
