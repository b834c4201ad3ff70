"""Decode side: finds prefill ranks through their bootstrap servers, registers this
rank's pool with each once, sends per-room destinations, heartbeats every known
prefill rank and turns prefill's status (and engine notifications) into receiver states.

Tensor parallel: a prefill DP rank is a group of TP ranks; this decode TP rank takes its KV
heads from the ones ``head_slices.slices_into`` names (its sources), registers with each, sends
each the room's destination, and a room succeeds here once every source reported success."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

import pdserve.kvtransfer.messages as m
from pdserve.engine.sched.page_pool import PagePool
from pdserve.kvtransfer.aux_pool import AuxPool
from pdserve.kvtransfer.bootstrap_client import fetch_rank, fetch_topology
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.errors import KVTransferError, TransferEngineError
from pdserve.kvtransfer.head_slices import TPPlace, layout_mismatch, slices_into
from pdserve.kvtransfer.kv_manager import KVManager, parse_room_notification
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.kvtransfer.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

_LOOKUP_RETRY_S = 0.2

PeerKey = tuple[str, int, int]  # (bootstrap_host, bootstrap_port, prefill dp rank)


@dataclass
class PrefillPeer:
    """A prefill DP rank: the TP ranks of it this decode rank takes heads from (its sources)."""

    key: PeerKey
    state: str = "resolving"  # resolving -> registering -> ready | failed
    reason: str | None = None
    routes: dict[int, m.RankRegistration] = field(default_factory=dict)  # source tp rank -> its registration
    acked: set[int] = field(default_factory=set)  # sources that accepted this pool
    # the prefill engines, where the backend needs them known (nixl notifications)
    engine_peers: dict[int, str] = field(default_factory=dict)
    receivers: set[int] = field(default_factory=set)
    next_lookup: float = 0.0
    lookup_inflight: bool = False
    lookup_detail: str = ""  # why the last lookup found no route (the bootstrap server's 503 names missing ranks)
    last_ack: dict[int, float] = field(default_factory=dict)  # per source
    # per source: heartbeats sent since its last reply. A peer fails on heartbeats this rank really
    # sent and got no reply to, not on the wall clock alone: a stall of this rank's own control
    # thread (seen: 3.4 s on a loaded 2-core host) sends nothing, so it must not fail a live peer
    unanswered: dict[int, int] = field(default_factory=dict)
    last_beat: float = 0.0
    seq: int = 0
    # per source TP rank: its transfer-engine peer info (RegisterAck), to retire it when dead
    engine_infos: dict[int, bytes] = field(default_factory=dict)

    @property
    def sources(self) -> frozenset[int]:
        return frozenset(self.routes)

    @property
    def endpoints(self) -> list[str]:
        return [r.endpoint for r in self.routes.values()]

    def source_of(self, endpoint: str) -> int | None:
        return next((tp for tp, r in self.routes.items() if r.endpoint == endpoint), None)

    def describe(self) -> str:
        host, port, dp = self.key
        eps = ", ".join(f"tp {tp} {r.endpoint}" for tp, r in self.routes.items())
        return f"prefill dp {dp} (bootstrap {host}:{port}{', ' + eps if eps else ''})"


@dataclass
class DeadCheck:
    """A prefill peer that stopped answering heartbeats. Probed at its bootstrap server until it is
    known dead (then its connection is torn down and its failed rooms closed) or the quarantine
    timeout covers its rooms anyway (a peer that is merely silent)."""

    peer: PrefillPeer
    since: float
    next_probe: float = 0.0
    probing: bool = False
    release_at: float | None = None  # set once dead: when its rooms count as closed


class DecodeKVManager(KVManager):
    role = "decode"

    def __init__(
        self,
        config: KVTransferConfig,
        pool: PagePool,
        *,
        aux_pool: AuxPool | None = None,
        engine: TransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
        tp: TPPlace = TPPlace(),
    ):
        super().__init__(config, pool, engine, clock)
        self.tp = tp
        self.kv_heads = tp.total_heads(self.layout.num_kv_heads)
        self.aux_pool = aux_pool or AuxPool(config.aux_num_slots, config.aux_max_top_logprobs)
        self._register(self.aux_pool.base_addr, self.aux_pool.nbytes)
        self.receivers: dict[int, KVReceiver] = {}
        self.peers: dict[PeerKey, PrefillPeer] = {}
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-bootstrap-lookup")
        self._awaiting_notify: set[int] = set()
        self.dead_checks: list[DeadCheck] = []

    # ---------------------------------------------------------- scheduler API
    def create_receiver(self, room: int, bootstrap_host: str, bootstrap_port: int, prefill_dp_rank: int = 0) -> KVReceiver:
        """A receiver for ``room``; WaitingForInput once the prefill rank accepted this pool."""
        receiver = KVReceiver(self, room, (bootstrap_host, int(bootstrap_port), int(prefill_dp_rank)), self.clock())
        with self.lock:
            if room in self.receivers and not self.receivers[room].state.done:
                raise KVTransferError(f"room {room} already has an open receiver")
            self.receivers[room] = receiver
        self.call_soon(lambda: self._attach(receiver))
        return receiver

    def init_receiver(self, receiver: KVReceiver, dst_pages: list[int], aux_slot: int) -> None:
        """``receiver.init``: the room's destination, sent once the prefill rank is ready (scheduler thread)."""
        bad = [p for p in dst_pages if not 0 < p < self.pool.num_pages]
        if bad:
            raise KVTransferError(f"room {receiver.room}: pages {bad[:4]} outside [1, {self.pool.num_pages})")
        if not 0 <= aux_slot < self.aux_pool.num_slots:
            raise KVTransferError(f"room {receiver.room}: aux slot {aux_slot} outside [0, {self.aux_pool.num_slots})")
        with self.lock:
            if receiver.dst_pages is not None:
                raise KVTransferError(f"room {receiver.room}: init() called twice")
            receiver.dst_pages = dst_pages
            receiver.aux_slot = aux_slot
        self.call_soon(lambda: self._maybe_request(receiver))

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        with self.lock:
            receiver = self.receivers.get(room)
            if receiver is None:
                return
            self._fail_receiver(receiver, reason)

    # ------------------------------------------------------------ room state
    def _fail_receiver(self, receiver: KVReceiver, reason: str, tell_peer: bool = True) -> None:
        """Call with ``lock`` held (any thread)."""
        if not self._finish(receiver, KVPoll.Failed, reason):
            return
        self._awaiting_notify.discard(receiver.room)
        peer = receiver.peer
        if tell_peer and peer is not None:
            msg = m.AbortRoom(receiver.room, reason, self.endpoint)
            for endpoint in peer.endpoints:
                self.call_soon(lambda e=endpoint: self.send_msg(e, msg))

    def _maybe_succeed(self, receiver: KVReceiver) -> None:
        """Call with ``lock`` held: Success once every source reported success and every notification
        one of them announced arrived."""
        if receiver.sources <= receiver.ok_from and receiver.notify_from <= receiver.notified_from:
            self._finish(receiver, KVPoll.Success)
            if logger.isEnabledFor(logging.DEBUG):  # the prefill logs its compute end on the same clock
                logger.debug("kv decode: room %d success at %.6f", receiver.room, time.time())
            self._awaiting_notify.discard(receiver.room)
        elif receiver.notify_from - receiver.notified_from:
            self._awaiting_notify.add(receiver.room)
            self._fast_poll = True

    def _attach(self, receiver: KVReceiver) -> None:
        """Control thread: bind the receiver to its peer, starting the lookup if new."""
        if receiver.state.done:
            return
        peer = self.peers.get(receiver.peer_key)
        if peer is None:
            peer = self.peers[receiver.peer_key] = PrefillPeer(receiver.peer_key)
        with self.lock:
            receiver.peer = peer
            peer.receivers.add(receiver.room)
            if peer.state == "failed":
                self._fail_receiver(receiver, peer.reason)
            elif peer.state == "ready" and receiver.state is KVPoll.Bootstrapping:
                receiver.state = KVPoll.WaitingForInput
        self._maybe_request(receiver)
        self._maybe_lookup(peer)

    def _maybe_request(self, receiver: KVReceiver) -> None:
        """Control thread: send the room's destination once both it and the peer are ready."""
        peer = receiver.peer
        with self.lock:
            if (
                peer is None
                or peer.state != "ready"
                or receiver.dst_pages is None
                or receiver.requested_at is not None
                or receiver.state.done
            ):
                return
            receiver.state = KVPoll.Transferring
            receiver.requested_at = self.clock()
            receiver.sources = peer.sources
        msg = m.RoomRequest(receiver.room, self.id, receiver.dst_pages, receiver.aux_slot, receiver.held_pages)
        for endpoint in peer.endpoints:
            self.send_msg(endpoint, msg)

    # ------------------------------------------------------- bootstrap lookup
    def _maybe_lookup(self, peer: PrefillPeer) -> None:
        if peer.state != "resolving" or peer.lookup_inflight or time.monotonic() < peer.next_lookup or not peer.receivers:
            return
        peer.lookup_inflight = True
        fut = self._lookups.submit(self._fetch_route, peer.key)
        fut.add_done_callback(lambda f: self.call_soon(lambda: self._on_route(peer, f)))

    @staticmethod
    def _fetch_route(key: PeerKey) -> m.Topology:
        host, port, _ = key
        return fetch_topology(host, port)

    def _on_route(self, peer: PrefillPeer, fut) -> None:
        peer.lookup_inflight = False
        if self.peers.get(peer.key) is not peer:
            return
        try:
            route = fut.result()
        except urllib.error.HTTPError as e:
            # 503: not every prefill rank registered yet; retry until the receivers time out
            detail = e.read().decode(errors="replace")
            peer.lookup_detail = f"bootstrap server answered HTTP {e.code}: {detail}"
            logger.info("kv decode: lookup %s: HTTP %d %s", peer.describe(), e.code, detail)
            if e.code not in (503, 404):
                self._fail_peer(peer, f"bootstrap lookup of {peer.describe()} failed: HTTP {e.code} {detail}")
                return
            peer.next_lookup = time.monotonic() + _LOOKUP_RETRY_S  # pacing, not a timeout: real time
            return
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, json.JSONDecodeError) as e:
            logger.info("kv decode: lookup %s: %s", peer.describe(), e)
            peer.next_lookup = time.monotonic() + _LOOKUP_RETRY_S  # pacing, not a timeout: real time
            return
        dp = peer.key[2]
        ranks = {r.tp_rank: r for r in route.ranks if r.dp_rank == dp}
        if not ranks:
            self._fail_peer(peer, f"{peer.describe()}: no such DP rank (prefill dp_size {route.dp_size})")
            return
        first = ranks[min(ranks)]
        their_heads = first.kv_heads or first.num_kv_heads
        try:
            sources = {s.src_rank for s in slices_into(self.tp.rank, route.tp_size, self.tp.size, self.kv_heads)}
        except ValueError as e:
            sources, split_error = {min(ranks)}, str(e)
        else:
            split_error = ""
        # known before any check fails, so that a failed room's abort reaches the prefill ranks too
        peer.routes = {tp: ranks[tp] for tp in sorted(sources)}
        diff = layout_mismatch(first.layout(), their_heads, self.layout, self.kv_heads)
        if diff:
            self._fail_peer(peer, diff)
            return
        if first.backend != self.engine.name:
            self._fail_peer(peer, f"transfer backend mismatch: prefill {first.backend} vs decode {self.engine.name}")
            return
        if split_error:
            self._fail_peer(peer, f"{peer.describe()} TP {route.tp_size} vs decode TP {self.tp.size}: {split_error}")
            return
        peer.state = "registering"
        now = self.clock()  # the heartbeat window starts now
        peer.last_ack = dict.fromkeys(peer.routes, now)
        peer.unanswered = dict.fromkeys(peer.routes, 0)
        for endpoint in peer.endpoints:
            self._register_pool(endpoint)

    def _register_pool(self, endpoint: str) -> None:
        self.send_msg(
            endpoint,
            m.RegisterPool(
                decode_id=self.id,
                endpoint=self.endpoint,
                backend=self.engine.name,
                peer_info=self.engine.peer_info(),
                layout=self.layout,
                num_pages=self.pool.num_pages,
                page_bytes=self.page_bytes,
                k_addrs=self.k_addrs,
                v_addrs=self.v_addrs,
                aux_addr=self.aux_pool.base_addr,
                aux_slot_bytes=self.aux_pool.slot_bytes,
                aux_num_slots=self.aux_pool.num_slots,
                tp_rank=self.tp.rank,
                tp_size=self.tp.size,
                kv_heads=self.kv_heads,
            ),
        )

    def _fail_peer(self, peer: PrefillPeer, reason: str, drop: bool = False) -> None:
        """Control thread: fail every open room of ``peer``; ``drop`` forgets it (so it is looked up anew)."""
        logger.warning("kv decode: %s", reason)
        peer.state, peer.reason = "failed", reason
        with self.lock:
            for room in peer.receivers:
                receiver = self.receivers.get(room)
                if receiver is not None:
                    # tell the peer even when it looks dead: a prefill that was only stalled
                    # (SIGSTOP, a long GC, a congested link) must drop these rooms when it wakes,
                    # not compute and send them ahead of new rooms (seen: new rooms then timed out)
                    self._fail_receiver(receiver, reason, tell_peer=True)
            peer.receivers.clear()
        if drop:
            self.peers.pop(peer.key, None)
            for engine_peer in peer.engine_peers.values():
                self.engine.disconnect(engine_peer)
            for endpoint in peer.endpoints:
                self.call_soon(lambda e=endpoint: self.drop_endpoint(e))

    # ---------------------------------------------------------- control thread
    def _on_message(self, msg: m.ControlMessage) -> None:
        if isinstance(msg, m.RoomStatus):
            with self.lock:
                receiver = self.receivers.get(msg.room)
                if receiver is None:
                    return
                if receiver.state.done:
                    # a room failed here that completed there anyway: all its writes have returned
                    if msg.success:
                        self._closed_from(receiver, msg.tp_rank)
                    return
                if not msg.success:
                    self._fail_receiver(receiver, f"prefill failed: {msg.reason}")
                    return
                receiver.ok_from.add(msg.tp_rank)
                receiver.on_status(msg.exposed_s)
                if msg.notified:
                    receiver.notify_from.add(msg.tp_rank)
                self._maybe_succeed(receiver)
        elif isinstance(msg, m.RoomClosed):
            with self.lock:
                receiver = self.receivers.get(msg.room)
                if receiver is not None:
                    self._closed_from(receiver, msg.tp_rank)
        elif isinstance(msg, m.AbortRoom):
            with self.lock:
                receiver = self.receivers.get(msg.room)
                if receiver is not None:
                    # the other sources (TP ranks) of the room must stop too
                    self._fail_receiver(receiver, f"aborted by prefill: {msg.reason}")
        elif isinstance(msg, m.RegisterAck):
            self._on_register_ack(msg)
        elif isinstance(msg, m.HeartbeatAck):
            for peer in self.peers.values():
                tp = peer.source_of(msg.endpoint)
                if peer.state in ("registering", "ready") and tp is not None:
                    peer.last_ack[tp] = self.clock()
                    peer.unanswered[tp] = 0
        else:
            logger.warning("kv decode: unexpected %s", type(msg).__name__)

    def _closed_from(self, receiver: KVReceiver, tp_rank: int) -> None:
        """Call with ``lock`` held: source ``tp_rank`` has no write of the room left; the room's pages
        are safe once every source said so."""
        receiver.closed_from.add(tp_rank)
        if receiver.sources <= receiver.closed_from:
            receiver.peer_closed = True

    def _on_register_ack(self, ack: m.RegisterAck) -> None:
        for peer in [p for p in self.peers.values() if p.state == "registering"]:
            tp = peer.source_of(ack.endpoint)
            if tp is None:
                continue
            if not ack.ok:
                self._fail_peer(peer, f"{peer.describe()} rejected this decode pool: {ack.reason}")
                continue
            peer.engine_infos[tp] = ack.peer_info
            if self.engine.supports_notifications and ack.peer_info:
                try:
                    peer.engine_peers[tp] = self.engine.connect(ack.peer_info)
                except TransferEngineError as e:
                    logger.warning("kv decode: connect back to %s: %s", peer.describe(), e)
            peer.acked.add(tp)
            peer.last_ack[tp] = self.clock()
            peer.unanswered[tp] = 0
            if peer.acked < peer.sources:
                continue
            peer.state = "ready"
            with self.lock:
                ready = [self.receivers[r] for r in peer.receivers if r in self.receivers]
                for receiver in ready:
                    if receiver.state is KVPoll.Bootstrapping:
                        receiver.state = KVPoll.WaitingForInput
            for receiver in ready:
                self._maybe_request(receiver)

    def _on_tick(self) -> None:
        if not self._awaiting_notify and not self.engine.supports_notifications:
            return
        notes = self.engine.get_notifications()
        if not notes and not self._awaiting_notify:
            return
        with self.lock:
            for note in notes:
                parsed = parse_room_notification(note)
                receiver = self.receivers.get(parsed[0]) if parsed is not None else None
                if receiver is None or receiver.state.done:
                    continue
                receiver.notified_from.add(parsed[1])
                if receiver.ok_from:
                    self._maybe_succeed(receiver)
            self._fast_poll = bool(self._awaiting_notify)

    def _on_timer(self, now: float) -> None:
        cfg = self.config
        with self.lock:
            for receiver in self.receivers.values():
                if receiver.state is KVPoll.Bootstrapping and now - receiver.created > cfg.bootstrap_timeout:
                    detail = receiver.peer.lookup_detail if receiver.peer is not None else ""
                    self._fail_receiver(receiver, f"prefill not reachable within bootstrap_timeout "
                                                  f"{cfg.bootstrap_timeout}s{' (' + detail + ')' if detail else ''}")
                elif (
                    receiver.state is KVPoll.Transferring
                    and receiver.requested_at is not None
                    and now - receiver.requested_at > cfg.waiting_timeout
                ):
                    self._fail_receiver(receiver, f"no KV from prefill within waiting_timeout {cfg.waiting_timeout}s")
            self._purge(self.receivers, now)
            for peer in self.peers.values():
                peer.receivers = {r for r in peer.receivers if r in self.receivers and not self.receivers[r].state.done}
        for peer in list(self.peers.values()):
            self._maybe_lookup(peer)
            if peer.state not in ("registering", "ready"):
                continue
            tp, last = min(peer.last_ack.items(), key=lambda kv: kv[1])
            if now - last > cfg.heartbeat_window and peer.unanswered.get(tp, 0) >= cfg.heartbeat_max_failures:
                self.dead_checks.append(DeadCheck(peer, now))
                self._fail_peer(
                    peer,
                    f"{peer.describe()} unreachable: no heartbeat reply from TP rank {tp} for {now - last:.1f}s "
                    f"({peer.unanswered[tp]} heartbeats unanswered, {cfg.heartbeat_max_failures} x {cfg.heartbeat_interval}s)",
                    drop=True,
                )
            elif now - peer.last_beat >= cfg.heartbeat_interval:
                peer.last_beat = now
                peer.seq += 1
                for endpoint in peer.endpoints:
                    self.send_msg(endpoint, m.Heartbeat(self.id, self.endpoint, peer.seq))
                for source in peer.routes:
                    peer.unanswered[source] = peer.unanswered.get(source, 0) + 1
        self._check_dead(now)
        # a failed peer (layout mismatch, rejected pool) is retried for new rooms later
        for key in [k for k, p in self.peers.items() if p.state == "failed" and not p.receivers]:
            del self.peers[key]

    # ------------------------------------------------- dead peers' quarantined rooms
    def _check_dead(self, now: float) -> None:
        """Control thread: probe each silent peer; close the rooms of a dead one once it is torn down."""
        cfg = self.config
        for check in list(self.dead_checks):
            if check.release_at is not None and now >= check.release_at:
                self.dead_checks.remove(check)
                self._close_rooms_of(check.peer)
            elif now - check.since > cfg.quarantine_timeout:
                self.dead_checks.remove(check)  # merely silent all along: the quarantine timer freed its rooms
            elif check.release_at is None and not check.probing and now >= check.next_probe:
                check.probing = True
                fut = self._lookups.submit(self._probe_dead, check.peer)
                fut.add_done_callback(lambda f, c=check: self.call_soon(lambda: self._on_probe(c, f)))

    def _probe_dead(self, peer: PrefillPeer) -> tuple[bool, bool]:
        """Lookup thread: (dead, torn_down). Dead: its bootstrap server refuses connections (the prefill
        server process, which owns its ranks, is gone) or no longer lists it at the same endpoint
        (restarted). Then its transfer-engine connection is torn down here before anything is released."""
        host, port, dp = peer.key
        try:
            routes = {tp: fetch_rank(host, port, dp, tp) for tp in peer.routes}
        except urllib.error.HTTPError as e:
            dead = e.code in (404, 503)
        except urllib.error.URLError as e:
            dead = isinstance(e.reason, ConnectionRefusedError)
        except ConnectionRefusedError:
            dead = True
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, json.JSONDecodeError):
            dead = False  # unreachable or garbled is not gone: a partitioned prefill may still write
        else:
            dead = any(routes[tp].endpoint != route.endpoint for tp, route in peer.routes.items())
        if not dead:
            return False, False
        infos = [info for info in peer.engine_infos.values() if info]
        return True, bool(infos) and all([self.engine.retire_peer(info) for info in infos])

    def _on_probe(self, check: DeadCheck, fut) -> None:
        check.probing = False
        try:
            dead, torn_down = fut.result()
        except Exception as e:  # noqa: BLE001 - a failed teardown is retried, never taken as done
            logger.warning("kv decode: probing %s: %r", check.peer.describe(), e)
            dead = torn_down = False
        now = self.clock()
        if not dead:
            check.next_probe = now + self.config.heartbeat_interval
            return
        # a backend that cannot tear the peer down: its process exit closed the connections; what
        # the kernel still buffered for them lands within a heartbeat interval
        check.release_at = now if torn_down else now + self.config.heartbeat_interval
        logger.warning("kv decode: %s is gone (bootstrap registration gone%s)", check.peer.describe(),
                       ", engine connection torn down" if torn_down else "")
        if torn_down:
            self.dead_checks.remove(check)
            self._close_rooms_of(check.peer)

    def _close_rooms_of(self, peer: PrefillPeer) -> None:
        """Control thread: no write of ``peer`` can land any more: its failed rooms are closed (the
        decode loop's quarantine releases their pages)."""
        with self.lock:
            rooms = [r for r in self.receivers.values() if r.peer is peer and r.state.done and not r.peer_closed]
            for receiver in rooms:
                receiver.peer_closed = True
        logger.info("kv decode: %d failed rooms of dead %s closed", len(rooms), peer.describe())

    def _close_extra(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
