"""A prefill rank forgets a decode rank that stopped heartbeating: its registration goes and its
control socket closes; a live decode, heartbeating, stays. Per-endpoint sockets are bounded."""

from __future__ import annotations

import time

import pytest
from support.loop_stand import PDPair, reference

import pdserve.kvtransfer.kv_manager as kv_manager
import pdserve.kvtransfer.messages as m

pytestmark = pytest.mark.timeout(30)


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_silent_decode_is_forgotten_and_its_socket_closed():
    pair = PDPair(heartbeat_interval=1.0, heartbeat_max_failures=2)
    try:
        prompt = list(range(100, 109))
        pair.submit("a", prompt, max_new=2)
        pair.run(pair.done("a"))
        assert pair.tokens("a") == reference(prompt, 2)
        pair.settle()
        prefill_kv, decode_kv = pair.prefill.kv, pair.decode.kv
        assert decode_kv.id in prefill_kv.decode_peers and decode_kv.endpoint in prefill_kv.open_endpoints

        pair.clock.advance(2.0)  # within the window (3 s): the live decode heartbeats and stays
        time.sleep(0.5)
        assert decode_kv.id in prefill_kv.decode_peers and prefill_kv.expired_peers == 0

        decode_kv.close()  # the decode dies: no more heartbeats
        pair.clock.advance(10.0)
        _wait(lambda: prefill_kv.expired_peers == 1)
        assert decode_kv.id not in prefill_kv.decode_peers
        assert decode_kv.endpoint not in prefill_kv.open_endpoints
    finally:
        pair.prefill.close()
        pair.bootstrap.stop_thread()


def test_per_endpoint_sockets_are_bounded(monkeypatch):
    monkeypatch.setattr(kv_manager, "MAX_PUSH_SOCKETS", 4)
    pair = PDPair()
    try:
        prefill_kv = pair.prefill.kv
        for port in range(20000, 20010):  # heartbeats naming ten endpoints (no key configured here)
            prefill_kv.call_soon(lambda p=port: prefill_kv.send_msg(f"127.0.0.1:{p}", m.RoomClosed(1)))
        _wait(lambda: f"127.0.0.1:{20009}" in prefill_kv.open_endpoints)
        assert len(prefill_kv.open_endpoints) == 4
        assert prefill_kv.open_endpoints[-1] == "127.0.0.1:20009"
    finally:
        pair.close()
