"""Prefill side: the scheduler-facing API of one prefill rank's KV transfer, composed of

- ``rank_registration``: this rank's entry in its bootstrap server (how decode ranks find it);
- ``decode_peers``: the peer directory (decode pools registered here, validated);
- ``sender_rooms``: the room state machine (senders from creation to Success or Failed);
- ``kv_writer``: the data plane (transfer threads writing KV pages and aux data);

over ``kv_manager``'s control channel (one control thread owns the sockets and the timers).
The scheduler thread creates senders and queues chunks; the control thread handles
``RegisterPool``, ``RoomRequest``, ``AbortRoom`` and ``Heartbeat``; the transfer threads write.

Peer expiry: a decode rank heartbeats every prefill rank it knows. One silent for
``heartbeat_interval * (heartbeat_max_failures + 1)`` with no room in flight here is forgotten:
its pool registration and engine connection go, and its control socket closes (a restarted
decode registers anew). Sockets to endpoints that never registered expire the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pdserve.kvtransfer.messages as m
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer.aux_pool import AuxData
from pdserve.engine.kv_transfer_config import KVTransferConfig
from pdserve.kvtransfer.decode_peers import DecodePeer, DecodePeers
from pdserve.kvtransfer.errors import KVTransferError, TransferEngineError
from pdserve.kvtransfer.head_slices import TPPlace, place_for
from pdserve.kvtransfer.kv_manager import KVManager
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.kv_writer import Chunk, KVWriter, SourcePool
from pdserve.kvtransfer.layer_signal import LayerSignal
from pdserve.kvtransfer.rank_registration import BootstrapRegistration
from pdserve.kvtransfer.sender_rooms import SenderRooms
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

# how long a rank keeps trying to reach its bootstrap server (started by the same prefill server)
_REGISTER_DEADLINE_S = 60.0


class PrefillKVManager(KVManager):
    role = "prefill"

    def __init__(
        self,
        config: KVTransferConfig,
        pool: PagePool,
        bootstrap_port: int | None = None,
        *,
        dp_rank: int = 0,
        tp: TPPlace = TPPlace(),
        bootstrap_host: str | None = None,
        engine: TransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
        aux_hidden_bytes: int = 0,
    ):
        """``aux_hidden_bytes``: the hidden state each room's aux data carries to a NEXTN decode
        (``nextn_handoff``); 0: none."""
        super().__init__(config, pool, engine, clock)
        self.dp_rank = dp_rank
        self.tp = tp = place_for(tp, self.layout.kind)
        self.kv_heads = tp.total_heads(self.layout.num_kv_heads)
        # the bootstrap server of this prefill server; None: the configured port
        self.bootstrap_host = bootstrap_host or config.host
        self.bootstrap_port = config.bootstrap_port if bootstrap_port is None else bootstrap_port
        self.src_bases = self.k_addrs + self.v_addrs
        self.writer = KVWriter(self.engine, SourcePool(self.src_bases, self.head_page_bytes, self.plane_bytes,
                                                       self.layout.num_layers),
                               config.num_transfer_threads, config.aux_max_top_logprobs, tp.rank, self.metrics,
                               self, self._ctx, self.frame, self._stop, aux_hidden_bytes)
        self._register(self.writer.staging.base_addr, self.writer.staging.nbytes)
        self.peers = DecodePeers(self.layout, self.kv_heads, self.engine.name, self.page_bytes, self.head_page_bytes,
                                 self.writer.staging.slot_bytes, aux_hidden_bytes)
        self.rooms = SenderRooms(self.metrics, clock, self.peers, tp, self.kv_heads, self.endpoint, self._tell)
        self._heard: dict[str, float] = {}  # control endpoint -> when a frame from it last came (clock)
        self.expired_peers = 0  # decode ranks forgotten for silence (tests, logs)
        self.registration = BootstrapRegistration(
            self.bootstrap_host, self.bootstrap_port, self._rank_registration(), config.frame_auth("bootstrap"),
            max(config.bootstrap_timeout, _REGISTER_DEADLINE_S), self._stop)

    def _rank_registration(self) -> m.RankRegistration:
        return m.RankRegistration(
            dp_rank=self.dp_rank,
            tp_rank=self.tp.rank,
            endpoint=self.endpoint,
            page_size=self.layout.page_size,
            kv_dtype=self.layout.dtype,
            num_layers=self.layout.num_layers,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.layout.head_dim,
            backend=self.engine.name,
            tp_size=self.tp.size,
            kv_heads=self.kv_heads,
            quantization=self.layout.quantization,
            model=self.layout.model,
            kv_kind=self.layout.kind,
        )

    def start(self) -> "PrefillKVManager":
        super().start()
        self.writer.start()
        self.registration.start()
        return self

    # what tests and benchmarks read of the parts
    @property
    def decode_peers(self) -> dict[str, DecodePeer]:
        return self.peers.peers

    @property
    def registered(self) -> threading.Event:
        """Set once the bootstrap server accepted this rank (or refused it: ``registration_error``)."""
        return self.registration.registered

    @property
    def registration_error(self) -> str | None:
        return self.registration.error

    # ---------------------------------------------------------- scheduler API
    def create_sender(self, room: int, lora: tuple[str | None, int] = (None, 0)) -> KVSender:
        """A sender for ``room``; WaitingForInput as soon as the decode side's destination is here.
        ``lora``: the adapter (name, lora id) the KV is computed under; a decode rank whose room
        request names another lora id is refused."""
        sender = KVSender(self, room, self.clock())
        sender.lora = lora
        with self.lock:
            self.rooms.open(sender)
        return sender

    def layer_signal(self) -> LayerSignal:
        """A prefill forward's per-layer progress, for ``send_chunk(layers=...)`` of the chunks it computes."""
        return LayerSignal(self.layout.num_layers, self.pool.device)

    def send_chunk(self, sender: KVSender, src_pages: list[int], is_last: bool, aux: AuxData | None,
                   layers: LayerSignal | None = None) -> None:
        """``sender.send``: queue a chunk of the room's pages for a transfer thread (from the scheduler thread).
        ``layers``: the pages are being computed by that forward; each layer goes as soon as it is stored."""
        if layers is not None and is_last:
            raise KVTransferError(f"room {sender.room}: a layer-wise chunk cannot be the last (the aux data follows it)")
        if is_last and logger.isEnabledFor(logging.DEBUG):
            # the end of the room's prefill compute, for the exposed transfer time (bench_pd_overhead)
            logger.debug("kv prefill: room %d compute done at %.6f", sender.room, time.time())
        with self.lock:
            span = self.rooms.start_chunk(sender, src_pages, is_last, self.pool.num_pages)
        if span is not None:
            self.writer.submit(Chunk(sender, src_pages, span[0], span[1], is_last, aux, layers))

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        with self.lock:
            self.rooms.abort(room, reason)

    # ------------------------------------------ the data plane's outcomes (RoomOutcome)
    def write_failed(self, sender: KVSender, reason: str) -> None:
        with self.lock:
            self.rooms.fail(sender, reason)

    def room_written(self, sender: KVSender) -> bool:
        with self.lock:
            return self.rooms.written(sender)

    def chunk_done(self, sender: KVSender) -> None:
        with self.lock:
            self.rooms.chunk_done(sender)

    # ---------------------------------------------------------- control thread
    def _tell(self, endpoint: str, msg: m.ControlMessage) -> None:
        """Send ``msg`` from the control thread, after what is queued there already (any thread)."""
        self.call_soon(lambda: self.send_msg(endpoint, msg))

    def _on_message(self, msg: m.ControlMessage) -> None:
        heard = getattr(msg, "endpoint", "")
        if not heard and isinstance(msg, m.RoomRequest):
            peer = self.peers.get(msg.decode_id)
            heard = peer.reg.endpoint if peer is not None else ""
        if heard:
            self._heard[heard] = self.clock()
        if isinstance(msg, m.RegisterPool):
            self._on_register_pool(msg)
        elif isinstance(msg, m.RoomRequest):
            self._on_room_request(msg)
        elif isinstance(msg, m.AbortRoom):
            with self.lock:
                unknown = self.rooms.on_abort(msg)
            if unknown and msg.endpoint:  # a room never started here (or long purged): nothing of it can be in flight
                self.send_msg(msg.endpoint, m.RoomClosed(msg.room, tp_rank=self.tp.rank))
        elif isinstance(msg, m.Heartbeat):
            self.send_msg(msg.endpoint, m.HeartbeatAck(self.id, self.endpoint, msg.seq))
        else:
            logger.warning("kv prefill: unexpected %s", type(msg).__name__)

    def _on_register_pool(self, reg: m.RegisterPool) -> None:
        reason = self.peers.check_pool(reg)
        engine_peer = None
        if reason is None:
            try:
                engine_peer = self.engine.connect(reg.peer_info)
            except TransferEngineError as e:
                reason = str(e)
        with self.lock:
            self.peers.add(reg, engine_peer, reason)
        if reason:
            logger.warning("kv prefill: rejected decode %s: %s", reg.decode_id, reason)
        self.send_msg(reg.endpoint, m.RegisterAck(self.id, self.endpoint, reason is None, reason or "", self.engine.peer_info()))

    def _on_room_request(self, req: m.RoomRequest) -> None:
        peer, problem = self.peers.check_request(req)
        if peer is None:
            logger.warning("kv prefill: room %d from unregistered decode %s dropped", req.room, req.decode_id)
            return
        with self.lock:
            for endpoint, msg in self.rooms.on_request(req, peer, problem):
                self.send_msg(endpoint, msg)

    def _on_timer(self, now: float) -> None:
        with self.lock:
            self.rooms.on_timer(now, self.config.bootstrap_timeout)
        self._expire(now)

    def _expire(self, now: float) -> None:
        """Forget decode ranks and close sockets of endpoints silent for the peer window (no room
        of theirs in flight)."""
        window = self.config.heartbeat_interval * (self.config.heartbeat_max_failures + 1)
        with self.lock:
            busy = {ep for sender in self.rooms.rooms.values() if not sender.state.done
                    for ep in self.rooms.endpoints(sender)}
            silent = {ep for ep in set(self._heard) | set(self.open_endpoints)
                      if now - self._heard.setdefault(ep, now) > window and ep not in busy}
            gone = [d for d, p in self.peers.peers.items() if p.reg.endpoint in silent]
            dropped = [self.peers.remove(d) for d in gone]
        for peer in dropped:
            self.expired_peers += 1
            logger.warning("kv prefill: decode %s (%s) silent for %.0f s: forgotten", peer.reg.decode_id,
                           peer.reg.endpoint, window)
            if peer.engine_peer is not None:
                try:
                    self.engine.disconnect(peer.engine_peer)
                except Exception as e:  # noqa: BLE001 - the peer is gone either way
                    logger.warning("kv prefill: disconnect %s: %s", peer.reg.decode_id, e)
        for ep in silent:
            self._heard.pop(ep, None)
            self.drop_endpoint(ep)

    def _close_extra(self) -> None:
        self.writer.close()
