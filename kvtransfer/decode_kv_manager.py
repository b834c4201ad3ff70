"""Decode side: the scheduler-facing API of one decode rank's KV transfer, composed of

- ``prefill_peers``: the peer directory (prefill ranks looked up through their bootstrap servers,
  this rank's pool registered with each once, heartbeats, dead peers probed);
- ``receiver_rooms``: the room state machine (receivers from creation to Success or Failed);
- the data plane, which is passive here: this rank's pool and aux slots are registered with the
  engine, and the engine's per-room notifications (``room_notification``) are read;

over ``kv_manager``'s control channel (one control thread owns the sockets and the timers; two
lookup threads run the blocking bootstrap calls).

Tensor parallel: a prefill DP rank is a group of TP ranks; this decode TP rank takes its KV
heads from the ones ``head_slices.slices_into`` names (its sources), registers with each, sends
each the room's destination, and a room succeeds here once every source reported success."""

from __future__ import annotations

import logging
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pdserve.kvtransfer.messages as m
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer.aux_pool import AuxPool
from pdserve.engine.kv_transfer_config import KVTransferConfig
from pdserve.kvtransfer.errors import TransferEngineError
from pdserve.kvtransfer.head_slices import TPPlace, place_for
from pdserve.kvtransfer.kv_manager import KVManager
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.kvtransfer.prefill_peers import DeadCheck, PrefillPeer, PrefillPeers, fetch_route, probe_dead
from pdserve.kvtransfer.receiver_rooms import ReceiverRooms
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

# bootstrap lookups and dead-peer probes run on these threads; one lookup per bootstrap host at a
# time (prefill_peers), so hosts that hang cannot hold them all for long
LOOKUP_THREADS = 4


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
        aux_hidden_bytes: int = 0,
    ):
        """``aux_hidden_bytes``: room in each aux slot for the prompt's last hidden state, which a
        NEXTN decode drafts from (``nextn_handoff``); 0: none."""
        super().__init__(config, pool, engine, clock)
        self.tp = tp = place_for(tp, self.layout.kind)
        self.kv_heads = tp.total_heads(self.layout.num_kv_heads)
        self.aux_pool = aux_pool or AuxPool(config.aux_num_slots, config.aux_max_top_logprobs, aux_hidden_bytes)
        self._register(self.aux_pool.base_addr, self.aux_pool.nbytes)
        self.rooms = ReceiverRooms(self.metrics, clock, self.id, self.endpoint, pool.num_pages, self.aux_pool.num_slots,
                                   self._tell)
        self.directory = PrefillPeers(tp, self.kv_heads, self.layout, self.engine.name, self.id, self.endpoint, clock)
        self._lookups = ThreadPoolExecutor(max_workers=LOOKUP_THREADS, thread_name_prefix="kv-bootstrap-lookup")

    # ---------------------------------------------------------- scheduler API
    def create_receiver(self, room: int, bootstrap_host: str, bootstrap_port: int, prefill_dp_rank: int = 0,
                        lora_id: int = 0) -> KVReceiver:
        """A receiver for ``room``; WaitingForInput once the prefill rank accepted this pool. ``lora_id``:
        the LoRA adapter the request decodes under (0: none), named in the room's request."""
        receiver = KVReceiver(self, room, (bootstrap_host, int(bootstrap_port), int(prefill_dp_rank)), self.clock())
        receiver.lora_id = lora_id
        with self.lock:
            self.rooms.add(receiver)
        self.call_soon(lambda: self._attach(receiver))
        return receiver

    def init_receiver(self, receiver: KVReceiver, dst_pages: list[int], aux_slot: int) -> None:
        """``receiver.init``: the room's destination, sent once the prefill rank is ready (scheduler thread)."""
        with self.lock:
            self.rooms.init(receiver, dst_pages, aux_slot)
        self.call_soon(lambda: self._maybe_request(receiver))

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        with self.lock:
            self.rooms.abort(room, reason)

    # ---------------------------------------------------------- control thread
    def _tell(self, endpoint: str, msg: m.ControlMessage) -> None:
        """Send ``msg`` from the control thread, after what is queued there already (any thread)."""
        self.call_soon(lambda: self.send_msg(endpoint, msg))

    def _attach(self, receiver: KVReceiver) -> None:
        """Bind the receiver to its peer, starting the lookup if new."""
        if receiver.state.done:
            return
        peer = self.directory.peer(receiver.peer_key)
        with self.lock:
            self.rooms.bind(receiver, peer)
        self._maybe_request(receiver)
        self._maybe_lookup(peer)

    def _maybe_request(self, receiver: KVReceiver) -> None:
        """Send the room's destination once both it and the peer are ready."""
        with self.lock:
            msg = self.rooms.request(receiver)
        if msg is not None:
            for endpoint in receiver.peer.endpoints:
                self.send_msg(endpoint, msg)

    def _maybe_lookup(self, peer: PrefillPeer) -> None:
        if not self.directory.lookup_due(peer):
            return
        fut = self._lookups.submit(fetch_route, peer.key)
        fut.add_done_callback(lambda f: self.call_soon(lambda: self._on_route(peer, f)))

    def _on_route(self, peer: PrefillPeer, fut: Future) -> None:
        exc = fut.exception()
        self.directory.lookup_ended(peer, isinstance(exc, OSError) and not isinstance(exc, urllib.error.HTTPError))
        if not self.directory.is_current(peer):
            return  # dropped while its lookup ran
        reason = self.directory.lookup_failed(peer, exc) if exc is not None else self.directory.accept_route(peer, fut.result())
        if reason is not None:
            self._fail_peer(peer, reason)
        elif peer.state == "registering":
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
                aux_hidden_bytes=self.aux_pool.hidden_bytes,
            ),
        )

    def _fail_peer(self, peer: PrefillPeer, reason: str, drop: bool = False) -> None:
        """Fail every open room of ``peer``; ``drop`` forgets it (so it is looked up anew)."""
        self.directory.fail(peer, reason)
        with self.lock:
            self.rooms.peer_failed(peer, reason)
        if drop:
            self.directory.drop(peer)
            for engine_peer in peer.engine_peers.values():
                self.engine.disconnect(engine_peer)
            for endpoint in peer.endpoints:
                self.call_soon(lambda e=endpoint: self.drop_endpoint(e))

    def _on_message(self, msg: m.ControlMessage) -> None:
        if isinstance(msg, m.RoomStatus):
            with self.lock:
                self.rooms.on_status(msg)
        elif isinstance(msg, m.RoomClosed):
            with self.lock:
                self.rooms.on_closed(msg)
        elif isinstance(msg, m.AbortRoom):
            with self.lock:
                self.rooms.on_abort(msg)
        elif isinstance(msg, m.RegisterAck):
            self._on_register_ack(msg)
        elif isinstance(msg, m.HeartbeatAck):
            self.directory.on_heartbeat_ack(msg.endpoint)
        else:
            logger.warning("kv decode: unexpected %s", type(msg).__name__)

    def _on_register_ack(self, ack: m.RegisterAck) -> None:
        for peer, tp in self.directory.registering(ack.endpoint):
            if not ack.ok:
                self._fail_peer(peer, f"{peer.describe()} rejected this decode pool: {ack.reason}")
                continue
            if self.engine.supports_notifications and ack.peer_info:
                try:
                    peer.engine_peers[tp] = self.engine.connect(ack.peer_info)
                except TransferEngineError as e:
                    logger.warning("kv decode: connect back to %s: %s", peer.describe(), e)
            if not self.directory.acked(peer, tp, ack.peer_info):
                continue
            with self.lock:
                ready = self.rooms.peer_ready(peer)
            for receiver in ready:
                self._maybe_request(receiver)

    def _wants_fast_poll(self) -> bool:
        return bool(self.rooms.awaiting_notify)

    def _on_tick(self) -> None:
        if not self.rooms.awaiting_notify and not self.engine.supports_notifications:
            return
        notes = self.engine.get_notifications()
        if not notes and not self.rooms.awaiting_notify:
            return
        with self.lock:
            self.rooms.on_notifications(notes)

    def _on_timer(self, now: float) -> None:
        cfg = self.config
        with self.lock:
            self.rooms.on_timer(now, cfg.bootstrap_timeout, cfg.waiting_timeout)
            for peer in self.directory.peers.values():
                peer.receivers = {r for r in peer.receivers if self.rooms.is_open(r)}
        for peer in list(self.directory.peers.values()):
            self._maybe_lookup(peer)
            dead, beat = self.directory.heartbeat(peer, now, cfg.heartbeat_window, cfg.heartbeat_max_failures,
                                                  cfg.heartbeat_interval)
            if dead is not None:
                self._fail_peer(peer, dead, drop=True)
            elif beat is not None:
                for endpoint in peer.endpoints:
                    self.send_msg(endpoint, beat)
        self._check_dead(now)
        self.directory.forget_failed()

    # ------------------------------------------------- dead peers' quarantined rooms
    def _check_dead(self, now: float) -> None:
        """Probe each silent peer; close the rooms of a dead one once it is torn down."""
        release, probe = self.directory.check_dead(now, self.config.quarantine_timeout)
        for peer in release:
            self._close_rooms_of(peer)
        for check in probe:
            fut = self._lookups.submit(probe_dead, check.peer, self.engine)
            fut.add_done_callback(lambda f, c=check: self.call_soon(lambda: self._on_probe(c, f)))

    def _on_probe(self, check: DeadCheck, fut: Future) -> None:
        try:
            dead, torn_down = fut.result()
        except Exception as e:  # noqa: BLE001 - a failed teardown is retried, never taken as done
            logger.warning("kv decode: probing %s: %r", check.peer.describe(), e)
            dead = torn_down = False
        if self.directory.on_probe(check, dead, torn_down, self.config.heartbeat_interval):
            self._close_rooms_of(check.peer)

    def _close_rooms_of(self, peer: PrefillPeer) -> None:
        with self.lock:
            n = self.rooms.peer_gone(peer)
        logger.info("kv decode: %d failed rooms of dead %s closed", n, peer.describe())

    def _close_extra(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
