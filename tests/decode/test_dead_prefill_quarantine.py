"""A failed room's quarantined pages when its prefill dies: released once the prefill is known dead
(heartbeat failed, bootstrap registration gone) and its transfer-engine connection is torn down,
within 2 heartbeat windows; a prefill that is merely silent keeps them until ``quarantine_timeout``."""

from __future__ import annotations

import threading
import time

import pytest
from loop_stand import PDPair

from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.engines.local_engine import LocalTransferEngine

pytestmark = pytest.mark.timeout(30)

HEARTBEAT = dict(heartbeat_interval=1.0, heartbeat_max_failures=2)  # a 2 s window on the FakeClock


class GatedEngine(LocalTransferEngine):
    """The local engine, whose teardown of a dead peer waits until the test opens the gate."""

    def __init__(self, host: str, torn_down: bool = True):
        super().__init__(host)
        self.torn_down = torn_down
        self.retire_started = threading.Event()
        self.gate = threading.Event()
        self.retired_done = threading.Event()

    def retire_peer(self, peer_info: bytes) -> bool:
        self.retire_started.set()
        assert self.gate.wait(20)
        ok = super().retire_peer(peer_info)
        self.retired_done.set()
        return ok and self.torn_down


def _room_in_flight(pair: PDPair, rid: str) -> None:
    """A request whose destination went to the prefill, which never writes it."""
    pair.submit(rid, list(range(500, 513)), max_new=3, to="D")
    pair.run(lambda: rid in pair.decode.transfer and pair.decode.transfer.entries[rid][1].poll() is KVPoll.Transferring,
             prefill=False)


def _fail_by_heartbeat(pair: PDPair, rid: str) -> float:
    """Kill the prefill's KV side, let the heartbeat window pass; returns the death's clock time."""
    pair.prefill.kv.close()
    died = pair.clock.now
    # half a heartbeat interval at a time: a peer fails on heartbeats the decode really sent and got
    # no reply to, so the clock must pass while its control thread runs (its timer: every 50 ms)
    for _ in range(4 * pair.kv_config.heartbeat_max_failures + 2):
        if pair.final("D", rid) is not None:
            break
        pair.clock.advance(pair.kv_config.heartbeat_interval / 2)
        _step_for(pair, 0.15)
    pair.run(lambda: pair.final("D", rid) is not None, prefill=False)
    assert "unreachable" in pair.final("D", rid).error
    assert len(pair.decode.quarantine) == 1
    return died


def _held(pair: PDPair) -> int:
    return len(pair.decode.quarantine.pages)


def _step_for(pair: PDPair, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pair.step(prefill=False)
        time.sleep(0.005)


def test_dead_prefill_pages_return_after_teardown_within_two_windows():
    engine = GatedEngine("127.0.0.1")
    pair = PDPair(d_transfer_engine=engine, **HEARTBEAT)
    try:
        _room_in_flight(pair, "r")
        pair.bootstrap.stop_thread()  # the prefill server process is gone with its bootstrap server
        died = _fail_by_heartbeat(pair, "r")
        assert engine.retire_started.wait(5)
        _step_for(pair, 0.3)
        assert _held(pair) > 0, "pages released before the dead peer's connection was torn down"
        engine.gate.set()
        pair.run(lambda: not pair.decode.quarantine, prefill=False)
        assert engine.retired_done.is_set()
        assert pair.clock.now - died < 2 * pair.kv_config.heartbeat_window
        assert pair.decode.pool.num_free == pair.decode.pool.capacity
        assert pair.decode.kv.aux_pool.num_free == pair.decode.kv.aux_pool.num_slots
    finally:
        engine.gate.set()
        pair.close()


def test_without_a_teardown_the_pages_wait_one_heartbeat_interval():
    engine = GatedEngine("127.0.0.1", torn_down=False)  # as Mooncake: no per-peer teardown
    engine.gate.set()
    pair = PDPair(d_transfer_engine=engine, **HEARTBEAT)
    try:
        _room_in_flight(pair, "r")
        pair.bootstrap.stop_thread()
        died = _fail_by_heartbeat(pair, "r")
        assert engine.retired_done.wait(5)
        _step_for(pair, 0.3)
        assert _held(pair) > 0
        pair.clock.advance(pair.kv_config.heartbeat_interval)
        pair.run(lambda: not pair.decode.quarantine, prefill=False)
        assert pair.clock.now - died < 2 * pair.kv_config.heartbeat_window
    finally:
        pair.close()


def test_silent_prefill_keeps_its_pages_until_the_quarantine_timeout():
    engine = GatedEngine("127.0.0.1")
    engine.gate.set()
    pair = PDPair(d_transfer_engine=engine, **HEARTBEAT)
    try:
        _room_in_flight(pair, "r")
        # the bootstrap server still lists the prefill at the same endpoint: silent, maybe alive
        _fail_by_heartbeat(pair, "r")
        pair.clock.advance(10.0)
        _step_for(pair, 0.5)
        assert _held(pair) > 0 and not engine.retire_started.is_set()
        pair.clock.advance(pair.kv_config.quarantine_timeout)
        pair.run(lambda: not pair.decode.quarantine, prefill=False)
        assert pair.decode.pool.num_free == pair.decode.pool.capacity
    finally:
        pair.close()


def test_a_stall_of_the_decode_itself_fails_no_live_prefill():
    """The clock jumps 3 heartbeat windows at once, as when the decode rank's own control thread
    stalls (seen: 3.4 s on a loaded 2-core host): no heartbeat went out meanwhile, so none went
    unanswered, and the live prefill keeps its rooms (before, they failed as "unreachable")."""
    pair = PDPair(**HEARTBEAT)
    try:
        _room_in_flight(pair, "r")
        pair.clock.advance(3 * pair.kv_config.heartbeat_window)
        _step_for(pair, 0.5)  # the decode's timer runs: one heartbeat goes out and is answered
        assert pair.final("D", "r") is None, pair.final("D", "r")
        pair.clock.advance(pair.kv_config.heartbeat_interval)
        _step_for(pair, 0.3)
        assert pair.final("D", "r") is None, pair.final("D", "r")
    finally:
        pair.close()
