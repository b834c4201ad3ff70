"""The prefill room state machine (``sender_rooms``) on plain data: no socket, no engine, a moved clock.
Each test reads what it told the decode ranks, in order."""

from __future__ import annotations

import pytest

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.decode_peers import DecodePeers
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.head_slices import TPPlace
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.sender_rooms import SenderRooms
from rooms_fixtures import AUX_SLOT_BYTES, HEAD_PAGE_BYTES, HEADS, LAYOUT, Clock, register_pool

POOL_PAGES = 32


class Stand:
    def __init__(self, tp: TPPlace = TPPlace(), kv_heads: int = HEADS):
        self.clock = Clock()
        self.told: list[tuple[str, m.ControlMessage]] = []
        self.peers = DecodePeers(LAYOUT, kv_heads, "local", HEAD_PAGE_BYTES * HEADS, HEAD_PAGE_BYTES, AUX_SLOT_BYTES)
        self.peers.add(register_pool(), "decode-engine", None)
        self.rooms = SenderRooms(RoomMetrics("prefill", 1024), self.clock, self.peers, tp, kv_heads, "prefill:0",
                                 lambda e, msg: self.told.append((e, msg)))

    def sender(self, room: int) -> KVSender:
        s = KVSender(None, room, self.clock())  # no manager: the tests drive the state machine directly
        self.rooms.open(s)
        return s

    def request(self, room: int, pages: list[int], decode_id: str = "d0") -> list:
        req = m.RoomRequest(room, decode_id, pages, 0)
        peer, problem = self.peers.check_request(req)
        return self.rooms.on_request(req, peer, problem)


def test_a_destination_before_its_sender_waits_then_the_room_runs_to_success():
    st = Stand()
    assert st.request(7, [3, 4, 5]) == []
    assert 7 in st.rooms.pending
    s = st.sender(7)
    assert s.poll() is KVPoll.WaitingForInput and st.rooms.pending == {}
    assert st.rooms.start_chunk(s, [1, 2], False, POOL_PAGES) == (0, 2)
    assert st.rooms.start_chunk(s, [9], True, POOL_PAGES) == (2, 3)
    assert s.poll() is KVPoll.Transferring and s.inflight == 2
    with pytest.raises(KVTransferError, match="after the last chunk"):
        st.rooms.start_chunk(s, [10], True, POOL_PAGES)
    st.rooms.chunk_done(s)
    assert st.rooms.written(s) and s.poll() is KVPoll.Success
    st.rooms.chunk_done(s)
    assert st.told == [] and s.inflight == 0  # a room that succeeded sends no RoomClosed


def test_bad_chunks_raise_or_fail_the_room():
    st = Stand()
    s = st.sender(1)
    with pytest.raises(KVTransferError, match="send\\(\\) in state Bootstrapping"):
        st.rooms.start_chunk(s, [1], True, POOL_PAGES)
    st.request(1, [3, 4])
    with pytest.raises(KVTransferError, match="outside \\[1, 32\\)"):
        st.rooms.start_chunk(s, [0], False, POOL_PAGES)
    assert st.rooms.start_chunk(s, [1, 2, 3], True, POOL_PAGES) is None
    assert s.poll() is KVPoll.Failed and s.failure_reason == "prefill sent 3 pages but decode preallocated 2"
    assert st.told == [("decode:1", m.AbortRoom(1, s.failure_reason, "prefill:0")), ("decode:1", m.RoomClosed(1))]


def test_a_failed_room_is_closed_only_once_its_writes_returned():
    st = Stand()
    st.request(2, [3, 4])
    s = st.sender(2)
    assert st.rooms.start_chunk(s, [1], False, POOL_PAGES) == (0, 1)
    st.rooms.abort(2, "client went away")
    assert st.told == [("decode:1", m.AbortRoom(2, "client went away", "prefill:0"))]  # no RoomClosed yet
    st.rooms.chunk_done(s)
    assert st.told[1:] == [("decode:1", m.RoomClosed(2))]
    assert st.rooms.start_chunk(s, [2], True, POOL_PAGES) is None  # the scheduler sees Failed next poll


def test_a_decode_abort_before_the_sender_fails_it_at_creation():
    st = Stand()
    assert st.rooms.on_abort(m.AbortRoom(5, "out of memory", "decode:1"))  # nothing here: caller closes at once
    s = st.sender(5)
    assert s.poll() is KVPoll.Failed and s.failure_reason == "aborted by decode: out of memory"
    assert st.told == []  # the decode side knows already


def test_a_decode_abort_of_a_running_room_skips_the_aborting_rank_and_closes_it():
    st = Stand()
    st.request(6, [3])
    s = st.sender(6)
    assert not st.rooms.on_abort(m.AbortRoom(6, "cancelled", "decode:1"))
    assert s.poll() is KVPoll.Failed
    assert st.told == [("decode:1", m.RoomClosed(6))]  # no AbortRoom back to the rank that aborted


def test_a_destination_after_the_room_failed_learns_why_at_once():
    st = Stand()
    s = st.sender(8)
    st.clock.t += 31
    st.rooms.on_timer(st.clock(), bootstrap_timeout=30)
    assert s.poll() is KVPoll.Failed and "bootstrap_timeout 30" in s.failure_reason
    assert st.request(8, [3]) == [("decode:1", m.AbortRoom(8, s.failure_reason, "prefill:0")),
                                  ("decode:1", m.RoomClosed(8))]


def test_a_bad_destination_fails_the_room_and_is_answered_with_its_reason():
    st = Stand()
    s = st.sender(9)
    out = st.request(9, [3, 99])
    assert out == [("decode:1", m.AbortRoom(9, "destination pages [99] outside decode pool [1, 16)"))]
    assert s.poll() is KVPoll.Failed and st.told == [("decode:1", m.RoomClosed(9))]


def test_stale_early_destinations_and_aborts_are_forgotten_and_ended_rooms_purged():
    st = Stand()
    st.request(10, [3])
    st.rooms.on_abort(m.AbortRoom(11, "x", "decode:1"))
    done = st.sender(12)
    st.rooms.abort(12, "gone")
    st.clock.t += 31
    st.rooms.on_timer(st.clock(), bootstrap_timeout=30)
    assert st.rooms.pending == {} and st.rooms.aborted_early == {} and 12 in st.rooms.rooms
    st.clock.t += 61
    st.rooms.on_timer(st.clock(), bootstrap_timeout=30)
    assert st.rooms.get(12) is None and done.poll() is KVPoll.Failed


def test_a_replica_rank_is_silent_and_follows_the_others():
    # TP 2 over 1 KV head: rank 1 holds a replica of rank 0's head and writes nothing
    st = Stand(TPPlace(1, 2, 1), kv_heads=1)
    assert st.rooms.silent
    s = st.sender(3)
    assert s.poll() is KVPoll.WaitingForInput
    assert st.rooms.start_chunk(s, [1], True, POOL_PAGES) is None
    assert s.poll() is KVPoll.Success and s.inflight == 0


def test_a_second_open_sender_of_a_room_is_refused():
    st = Stand()
    st.sender(4)
    with pytest.raises(KVTransferError, match="already has an open sender"):
        st.sender(4)


def test_a_destination_under_another_lora_adapter_fails_the_room():
    """The room's request names the adapter the decode runs it under (its lora id): a prefill that
    computed the KV under another refuses the room before any write, naming the adapter, and both
    sides learn it (the decode frees its pages on the RoomClosed that follows)."""
    st = Stand()
    s = st.sender(5)
    s.lora = ("a", 11)
    req = m.RoomRequest(5, "d0", [3, 4], 0, lora_id=12)
    peer, problem = st.peers.check_request(req)
    assert st.rooms.on_request(req, peer, problem) == []
    assert s.poll() is KVPoll.Failed and "LoRA adapter mismatch" in s.failure_reason
    assert "'a' (lora id 11)" in s.failure_reason and "lora id 12" in s.failure_reason
    assert [type(msg) for _, msg in st.told] == [m.AbortRoom, m.RoomClosed]
    same = st.sender(6)
    same.lora = ("a", 11)
    req = m.RoomRequest(6, "d0", [7], 0, lora_id=11)
    assert st.rooms.on_request(req, *st.peers.check_request(req)) == []
    assert same.poll() is KVPoll.WaitingForInput
