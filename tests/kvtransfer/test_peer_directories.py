"""The peer directories on plain data: the prefill's (``decode_peers``: pool validation) and the decode's
(``prefill_peers``: route checks, registration acks, heartbeats, dead peers). Probes go to real sockets."""

from __future__ import annotations

import io
import socket
import urllib.error

import pytest
from rooms_fixtures import AUX_SLOT_BYTES, HEAD_PAGE_BYTES, HEADS, LAYOUT, Clock, rank, register_pool

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.bootstrap_client import register_rank
from pdserve.kvtransfer.bootstrap_server import BootstrapServer
from pdserve.kvtransfer.decode_peers import DecodePeers
from pdserve.kvtransfer.head_slices import TPPlace
from pdserve.kvtransfer.engines.local_engine import LocalTransferEngine
from pdserve.kvtransfer.prefill_peers import DeadCheck, PrefillPeer, PrefillPeers, probe_dead


# ---------------------------------------------------------------- prefill side: decode pools
def decode_peers(kv_heads: int = HEADS, heads: int = HEADS) -> DecodePeers:
    layout = m.LayoutInfo(LAYOUT.num_layers, LAYOUT.page_size, heads, LAYOUT.head_dim, LAYOUT.dtype)
    return DecodePeers(layout, kv_heads, "local", HEAD_PAGE_BYTES * heads, HEAD_PAGE_BYTES, AUX_SLOT_BYTES)


@pytest.mark.parametrize("reg,why", [
    (register_pool(), None),
    (register_pool(backend="nixl"), "transfer backend mismatch: prefill local vs decode nixl"),
    (register_pool(heads=1), "num_kv_heads: 2 vs 1"),
    (register_pool(layers=1), "decode registered 1/1 K/V buffers for 2 layers"),
    (register_pool(page_bytes=HEAD_PAGE_BYTES), "page bytes mismatch"),
    (register_pool(aux_slot_bytes=32), "bad decode pool: 16 pages, 4 aux slots of 32 bytes"),
    (register_pool(num_pages=1), "bad decode pool: 1 pages"),
])
def test_a_decode_pool_is_checked_against_this_rank(reg, why):
    got = decode_peers().check_pool(reg)
    assert got == why if why is None else why in got


def test_decode_tp_ranks_register_their_share_of_the_heads():
    # TP 2 prefill rank 0 (heads 0-1 of 4) and a TP 2 decode rank 1 (heads 2-3): a share of 2 each
    peers = decode_peers(kv_heads=4, heads=2)
    assert peers.check_pool(register_pool(heads=2, tp_rank=1, tp_size=2, kv_heads=4)) is None
    assert "holds 1 KV heads, not 2" in peers.check_pool(register_pool(heads=1, tp_rank=1, tp_size=2, kv_heads=4))
    assert "decode TP rank 0 of 3" in peers.check_pool(register_pool(heads=2, tp_rank=0, tp_size=3, kv_heads=4))


def test_a_destination_must_lie_in_the_registered_pool():
    peers = decode_peers()
    assert peers.check_request(m.RoomRequest(1, "d0", [3], 0)) == (None, None)  # never registered: dropped
    peer = peers.add(register_pool(), "engine-peer", None)
    assert peer.dst_bases[:2] == list(register_pool().k_addrs) and peer.plane_bytes == HEAD_PAGE_BYTES * 16
    assert peers.check_request(m.RoomRequest(1, "d0", [1, 15], 3)) == (peer, None)
    assert peers.check_request(m.RoomRequest(1, "d0", [0, 16], 0))[1] == \
        "destination pages [0, 16] outside decode pool [1, 16)"
    assert peers.check_request(m.RoomRequest(1, "d0", [3], 4))[1] == "aux slot 4 outside [0, 4)"
    rejected = peers.add(register_pool(decode_id="d1"), None, "layout mismatch")
    assert peers.check_request(m.RoomRequest(1, "d1", [3], 0)) == (rejected, "layout mismatch")


# ---------------------------------------------------------------- decode side: prefill ranks
def prefill_peers(tp: TPPlace = TPPlace(), clock: Clock | None = None) -> PrefillPeers:
    return PrefillPeers(tp, HEADS, LAYOUT, "local", "d0", "decode:1", clock or Clock())


def resolving(directory: PrefillPeers, key=("127.0.0.1", 8998, 0)) -> PrefillPeer:
    peer = directory.peer(key)
    peer.receivers.add(1)
    assert directory.lookup_due(peer) and not directory.lookup_due(peer)  # one lookup in flight
    return peer


def test_a_route_picks_this_ranks_sources_and_registers_with_each():
    directory = prefill_peers()
    peer = resolving(directory)
    # prefill TP 2 over 2 heads (one each): a TP 1 decode rank takes heads from both
    topo = m.Topology(1, 2, [rank(0, 2, heads=1, kv_heads=2), rank(1, 2, heads=1, kv_heads=2)])
    assert directory.accept_route(peer, topo) is None
    assert peer.state == "registering" and peer.sources == {0, 1} and peer.endpoints == ["prefill:0", "prefill:1"]
    assert directory.registering("prefill:1") == [(peer, 1)]
    assert not directory.acked(peer, 1, b"p1") and peer.state == "registering"
    assert directory.acked(peer, 0, b"p0") and peer.state == "ready"


@pytest.mark.parametrize("topo,why", [
    (m.Topology(1, 1, [rank(dp_rank=1)]), "no such DP rank (prefill dp_size 1)"),
    (m.Topology(1, 1, [rank(backend="mooncake")]), "transfer backend mismatch: prefill mooncake vs decode local"),
    (m.Topology(1, 1, [rank(page_size=16)]), "page_size: 16 vs 4"),
    (m.Topology(1, 3, [rank(0, 3, heads=1, kv_heads=2)]), "TP 3 vs decode TP 1"),
])
def test_a_route_that_cannot_serve_this_rank_fails_the_peer(topo, why):
    directory = prefill_peers()
    peer = resolving(directory)
    assert why in directory.accept_route(peer, topo)
    assert peer.state == "resolving" and not peer.lookup_inflight


def test_a_lookup_error_is_retried_unless_the_server_refused_for_good():
    directory = prefill_peers()
    peer = resolving(directory)
    e503 = urllib.error.HTTPError("u", 503, "busy", {}, io.BytesIO(b"1 of 2 TP ranks registered"))
    assert directory.lookup_failed(peer, e503) is None and not peer.lookup_inflight
    assert peer.lookup_detail == "bootstrap server answered HTTP 503: 1 of 2 TP ranks registered"
    assert not directory.lookup_due(peer)  # paced
    assert directory.lookup_failed(peer, ConnectionRefusedError()) is None
    e400 = urllib.error.HTTPError("u", 400, "bad", {}, io.BytesIO(b"bad dp_rank"))
    assert directory.lookup_failed(peer, e400) == f"bootstrap lookup of {peer.describe()} failed: HTTP 400 bad dp_rank"
    with pytest.raises(ZeroDivisionError):
        directory.lookup_failed(peer, ZeroDivisionError())


def test_heartbeats_fail_a_peer_only_on_beats_it_left_unanswered():
    clock = Clock()
    directory = prefill_peers(clock=clock)
    peer = resolving(directory)
    directory.accept_route(peer, m.Topology(1, 1, [rank()]))
    window, fails, interval = 3.0, 3, 1.0
    assert directory.heartbeat(peer, clock.t, window, fails, interval) == (None, m.Heartbeat("d0", "decode:1", 1))
    assert directory.heartbeat(peer, clock.t + 0.5, window, fails, interval) == (None, None)  # not due
    clock.t += 10  # this rank stalled: no beat went out, so the silence proves nothing
    assert directory.heartbeat(peer, clock.t, window, fails, interval)[0] is None
    directory.on_heartbeat_ack("prefill:0")
    assert peer.unanswered == {0: 0}
    for _ in range(3):
        clock.t += interval
        assert directory.heartbeat(peer, clock.t, window, fails, interval)[1] is not None
    clock.t += interval
    why, beat = directory.heartbeat(peer, clock.t, window, fails, interval)
    assert beat is None and "no heartbeat reply from TP rank 0 for 4.0s (3 heartbeats unanswered" in why
    assert [c.peer for c in directory.dead_checks] == [peer]


def test_a_dead_peer_is_probed_until_gone_or_covered_by_the_quarantine():
    clock = Clock()
    directory = prefill_peers(clock=clock)
    peer, other = directory.peer(("a", 1, 0)), directory.peer(("b", 1, 0))
    directory.dead_checks += [DeadCheck(peer, clock.t), DeadCheck(other, clock.t)]
    release, probe = directory.check_dead(clock.t, quarantine_timeout=30)
    assert release == [] and [c.peer for c in probe] == [peer, other]
    assert directory.check_dead(clock.t, quarantine_timeout=30) == ([], [])  # probes in flight
    assert not directory.on_probe(probe[0], dead=False, torn_down=False, interval=1.0)  # still listed: probe again
    assert directory.on_probe(probe[1], dead=True, torn_down=True, interval=1.0)  # torn down: rooms closed now
    clock.t += 1
    assert [c.peer for c in directory.check_dead(clock.t, 30)[1]] == [peer]
    assert not directory.on_probe(probe[0], dead=True, torn_down=False, interval=1.0)  # gone, not torn down
    clock.t += 1
    assert directory.check_dead(clock.t, 30) == ([peer], [])  # its buffered writes had an interval to land
    assert directory.dead_checks == []


def test_probe_reads_the_bootstrap_server():
    engine = LocalTransferEngine("127.0.0.1")
    server = BootstrapServer("127.0.0.1", 0).start_in_thread()
    try:
        peer = PrefillPeer(("127.0.0.1", server.port, 0), routes={0: rank(endpoint="127.0.0.1:5000")})
        assert probe_dead(peer, engine) == (True, False)  # registered nowhere: gone (no engine info to retire)
        register_rank("127.0.0.1", server.port, rank(endpoint="127.0.0.1:5000"))
        assert probe_dead(peer, engine) == (False, False)  # listed at the same endpoint: alive
        moved = PrefillPeer(peer.key, routes={0: rank(endpoint="127.0.0.1:5001")}, engine_infos={0: b"x"})
        assert probe_dead(moved, engine) == (True, True)  # restarted elsewhere: torn down here
    finally:
        server.stop_thread()
    with socket.socket() as s:  # a port nobody listens on: the prefill server is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe_dead(PrefillPeer(("127.0.0.1", port, 0), routes={0: rank()}), engine) == (True, False)
    engine.close()


def test_dead_bootstrap_hosts_cannot_hold_every_lookup():
    """One lookup per bootstrap host at a time; a host that did not answer is backed off, doubling,
    while other hosts' lookups go on."""
    directory = prefill_peers()
    dead0 = resolving(directory, ("192.0.2.1", 8998, 0))
    dead1 = directory.peer(("192.0.2.1", 8998, 1))
    dead1.receivers.add(2)
    assert not directory.lookup_due(dead1)  # the same host: waits for the lookup in flight
    alive = resolving(directory, ("127.0.0.1", 8998, 0))  # another host goes on meanwhile
    directory.lookup_ended(dead0, unreachable=True)
    directory.lookup_failed(dead0, OSError("timed out"))
    dead0.next_lookup = 0.0
    assert not directory.lookup_due(dead0) and not directory.lookup_due(dead1)  # negative cache
    assert directory.host_down[("192.0.2.1", 8998)][1] == 1
    directory.host_down[("192.0.2.1", 8998)] = (0.0, 1)  # the backoff passed
    assert directory.lookup_due(dead1)
    directory.lookup_ended(dead1, unreachable=True)
    assert directory.host_down[("192.0.2.1", 8998)][1] == 2  # doubled
    directory.lookup_ended(alive, unreachable=False)
    assert ("127.0.0.1", 8998) not in directory.host_down and not directory.host_busy - {("192.0.2.1", 8998)}
