"""The decode room state machine (``receiver_rooms``) on plain data: a prefill peer of two TP sources,
no socket, no engine, a moved clock. Each test reads what it told the prefill ranks, in order."""

from __future__ import annotations

import pytest
from rooms_fixtures import Clock, rank

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.kvtransfer.prefill_peers import PrefillPeer
from pdserve.kvtransfer.receiver_rooms import ReceiverRooms
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.room_notification import room_notification

KEY = ("127.0.0.1", 8998, 0)


class Stand:
    def __init__(self):
        self.clock = Clock()
        self.told: list[tuple[str, m.ControlMessage]] = []
        self.rooms = ReceiverRooms(RoomMetrics("decode", 1024), self.clock, "d0", "decode:1", 16, 4,
                                   lambda e, msg: self.told.append((e, msg)))
        self.peer = PrefillPeer(KEY, routes={0: rank(0, 2), 1: rank(1, 2)})

    def receiver(self, room: int, peer: PrefillPeer | None = None) -> KVReceiver:
        r = KVReceiver(None, room, KEY, self.clock())  # no manager: the tests drive the state machine directly
        self.rooms.add(r)
        self.rooms.bind(r, peer or self.peer)
        return r

    def transferring(self, room: int) -> KVReceiver:
        self.peer.state = "ready"
        r = self.receiver(room)
        self.rooms.init(r, [3, 4], 1)
        assert self.rooms.request(r) == m.RoomRequest(room, "d0", [3, 4], 1)
        return r


def test_a_room_waits_for_its_peer_then_for_every_source_and_notification():
    st = Stand()
    r = st.receiver(1)
    assert r.poll() is KVPoll.Bootstrapping and st.rooms.request(r) is None
    st.peer.state = "ready"
    assert st.rooms.peer_ready(st.peer) == [r] and r.poll() is KVPoll.WaitingForInput
    assert st.rooms.request(r) is None  # no destination yet
    st.rooms.init(r, [3, 4], 1)
    assert st.rooms.request(r) == m.RoomRequest(1, "d0", [3, 4], 1)
    assert st.rooms.request(r) is None  # sent once
    assert r.poll() is KVPoll.Transferring and r.sources == {0, 1}
    st.rooms.on_status(m.RoomStatus(1, True, tp_rank=0))
    assert r.poll() is KVPoll.Transferring
    st.rooms.on_status(m.RoomStatus(1, True, notified=True, tp_rank=1))
    assert r.poll() is KVPoll.Transferring and st.rooms.awaiting_notify == {1}  # its data may still be landing
    st.rooms.on_notifications([b"garbage", room_notification(1, 1)])
    assert r.poll() is KVPoll.Success and st.rooms.awaiting_notify == set()
    assert st.told == []


def test_bad_destinations_are_refused():
    st = Stand()
    r = st.receiver(2)
    with pytest.raises(KVTransferError, match="pages \\[0\\] outside \\[1, 16\\)"):
        st.rooms.init(r, [0, 3], 0)
    with pytest.raises(KVTransferError, match="aux slot 4 outside \\[0, 4\\)"):
        st.rooms.init(r, [3], 4)
    st.rooms.init(r, [3], 0)
    with pytest.raises(KVTransferError, match="init\\(\\) called twice"):
        st.rooms.init(r, [3], 0)


def test_a_failed_room_tells_every_source_and_is_closed_once_every_source_closed_it():
    st = Stand()
    r = st.transferring(3)
    st.rooms.abort(3, "client went away")
    assert st.told == [("prefill:0", m.AbortRoom(3, "client went away", "decode:1")),
                       ("prefill:1", m.AbortRoom(3, "client went away", "decode:1"))]
    st.rooms.on_closed(m.RoomClosed(3, tp_rank=0))
    assert not r.peer_closed  # source 1 may still be writing into its pages
    st.rooms.on_status(m.RoomStatus(3, True, tp_rank=1))  # it completed there anyway: nothing left in flight
    assert r.peer_closed and r.poll() is KVPoll.Failed


def test_a_prefill_abort_or_failure_fails_the_room_and_tells_the_other_sources():
    st = Stand()
    r = st.transferring(4)
    st.rooms.on_abort(m.AbortRoom(4, "prefill OOM", "prefill:0"))
    assert r.failure_reason == "aborted by prefill: prefill OOM"
    assert [e for e, _ in st.told] == ["prefill:0", "prefill:1"]
    r2 = st.transferring(5)
    st.rooms.on_status(m.RoomStatus(5, False, "write failed", tp_rank=1))
    assert r2.poll() is KVPoll.Failed and r2.failure_reason == "prefill failed: write failed"


def test_timeouts_fail_rooms_and_name_why():
    st = Stand()
    st.peer.lookup_detail = "bootstrap server answered HTTP 503: 1 of 2 TP ranks"
    boot = st.receiver(6)
    waiting = st.transferring(7)
    st.clock.t += 31
    st.rooms.on_timer(st.clock(), bootstrap_timeout=30, waiting_timeout=60)
    assert boot.failure_reason == ("prefill not reachable within bootstrap_timeout 30s "
                                   "(bootstrap server answered HTTP 503: 1 of 2 TP ranks)")
    assert waiting.poll() is KVPoll.Transferring
    st.clock.t += 30
    st.rooms.on_timer(st.clock(), bootstrap_timeout=30, waiting_timeout=60)
    assert waiting.failure_reason == "no KV from prefill within waiting_timeout 60s"
    st.clock.t += 61
    st.rooms.on_timer(st.clock(), bootstrap_timeout=30, waiting_timeout=60)
    assert st.rooms.rooms == {}  # purged


def test_a_failed_peer_fails_its_rooms_and_a_dead_one_closes_them():
    st = Stand()
    st.peer.state = "failed"
    st.peer.reason = "layout mismatch"
    late = st.receiver(8)
    assert late.failure_reason == "layout mismatch"  # binds to a failed peer: fails at once
    live = PrefillPeer(("10.0.0.1", 8998, 0), state="ready", routes={0: rank(0, 1, endpoint="p:9")})
    a, b = st.receiver(9, live), st.receiver(10, live)
    st.rooms.peer_failed(live, "p unreachable")
    assert a.failure_reason == b.failure_reason == "p unreachable" and live.receivers == set()
    assert not a.peer_closed and st.rooms.peer_gone(live) == 2 and a.peer_closed and b.peer_closed
    assert not late.peer_closed  # another peer's room
