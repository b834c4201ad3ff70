"""Prefill side: registers with the bootstrap server, accepts decode pools and room
destinations on the control channel, and writes KV pages and aux data on transfer threads."""

from __future__ import annotations

import logging
import queue
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass

import zmq

import pdserve.kvtransfer.messages as m
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.kvtransfer.aux_pool import AuxData, AuxPool
from pdserve.kvtransfer.bootstrap_client import register_rank
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.errors import KVTransferError, TransferEngineError
from pdserve.kvtransfer.head_slices import HeadSlice, TPPlace, kv_head_range, layout_mismatch, slices_from
from pdserve.kvtransfer.kv_manager import KVManager, room_notification
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.layer_signal import Doorbell, LayerSignal
from pdserve.kvtransfer.page_runs import slice_descriptors, split_by_layer
from pdserve.kvtransfer.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

# how long a rank keeps trying to reach its bootstrap server (started by the same prefill server)
_REGISTER_DEADLINE_S = 60.0


@dataclass
class DecodePeer:
    """A decode rank's registered pool, as validated here."""

    reg: m.RegisterPool
    engine_peer: str | None  # None when rejected
    reject_reason: str | None
    dst_bases: list[int]  # all layers' K then V, head 0's page-0 addresses

    @property
    def plane_bytes(self) -> int:
        """One head's pages in the decode pool: the stride between its heads (head-major, page_pool)."""
        return self.reg.page_bytes // self.reg.layout.num_kv_heads * self.reg.num_pages


@dataclass
class _Dest:
    """One decode TP rank's destination of a room, and the head slices this rank writes there."""

    peer: DecodePeer
    request: m.RoomRequest
    slices: list[HeadSlice]


@dataclass
class _Chunk:
    sender: KVSender
    src_pages: list[int]
    start: int  # the chunk's pages are the destinations' dst_pages[start:end]
    end: int
    is_last: bool
    aux: AuxData | None
    # layer-wise: the step computing these pages; each layer is written once the forward stored it
    layers: LayerSignal | None = None


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
    ):
        super().__init__(config, pool, engine, clock)
        self.dp_rank = dp_rank
        self.tp = tp
        self.kv_heads = tp.total_heads(self.layout.num_kv_heads)
        # a replica of KV heads a lower TP rank also holds sends nothing (see head_slices)
        self.silent = not slices_from(tp.rank, tp.size, 1, self.kv_heads)
        # the bootstrap server of this prefill server; None: the configured port
        self.bootstrap_host = bootstrap_host or config.host
        self.bootstrap_port = config.bootstrap_port if bootstrap_port is None else bootstrap_port
        self.src_bases = self.k_addrs + self.v_addrs
        # one staging aux slot per transfer thread: a thread has one room's aux in flight at a time
        self._aux_staging = AuxPool(config.num_transfer_threads, config.aux_max_top_logprobs)
        self._register(self._aux_staging.base_addr, self._aux_staging.nbytes)
        self.senders: dict[int, KVSender] = {}
        self._pending: dict[int, list[tuple[m.RoomRequest, float]]] = {}  # destinations that came before the sender
        # rooms a decode rank aborted before their sender existed: (reason, when); the sender fails at
        # creation instead of prefilling for nobody and waiting bootstrap_timeout for a destination
        self._aborted_early: dict[int, tuple[str, float]] = {}
        self.decode_peers: dict[str, DecodePeer] = {}
        self.registered = threading.Event()  # set once the bootstrap server accepted this rank
        self.registration_error: str | None = None
        self._queues = [queue.SimpleQueue() for _ in range(config.num_transfer_threads)]
        # layer-wise: what each transfer thread sleeps on while the forward of its chunk runs
        self._bells = [Doorbell() for _ in range(config.num_transfer_threads)]
        # ZMQ sockets are single-thread: each transfer thread owns its own, per decode endpoint
        self._worker_push: list[dict[str, zmq.Socket]] = [{} for _ in range(config.num_transfer_threads)]
        self._workers = [
            threading.Thread(target=self._transfer_loop, args=(i,), name=f"kv-transfer-{i}", daemon=True)
            for i in range(config.num_transfer_threads)
        ]
        self._bootstrap_auth = config.frame_auth("bootstrap")
        self._reg_thread = threading.Thread(target=self._register_with_bootstrap, name="kv-bootstrap-reg", daemon=True)

    def start(self) -> "PrefillKVManager":
        super().start()
        for w in self._workers:
            w.start()
        self._reg_thread.start()
        return self

    # ---------------------------------------------------------- scheduler API
    def create_sender(self, room: int) -> KVSender:
        """A sender for ``room``; WaitingForInput as soon as the decode side's destination is here."""
        sender = KVSender(self, room, self.clock())
        with self.lock:
            if room in self.senders and not self.senders[room].state.done:
                raise KVTransferError(f"room {room} already has an open sender")
            self.senders[room] = sender
            early = self._aborted_early.pop(room, None)
            if early is not None:
                # the decode side knows; its other TP ranks' destinations wait for their own abort
                self._pending.pop(room, None)
                self._fail_sender(sender, early[0], tell_peer=False)
                return sender
            if self.silent:
                sender.state = KVPoll.WaitingForInput  # nothing to wait for: it follows the others
            for req, _ in self._pending.pop(room, []):
                self._attach(sender, req)
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
            if sender.state is KVPoll.Failed:
                return  # the scheduler sees Failed on its next poll
            if sender.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                raise KVTransferError(f"room {sender.room}: send() in state {sender.state.name}")
            if sender.last_sent:
                raise KVTransferError(f"room {sender.room}: send() after the last chunk")
            bad = [p for p in src_pages if not 0 < p < self.pool.num_pages]
            if bad:
                raise KVTransferError(f"room {sender.room}: local pages {bad[:4]} outside [1, {self.pool.num_pages})")
            start, end = sender.pages_sent, sender.pages_sent + len(src_pages)
            for dest in sender.dests.values():
                got = len(dest.request.dst_pages)
                if end > got or (is_last and end != got):
                    self._fail_sender(sender, f"prefill sent {end} pages but decode preallocated {got}")
                    return
            sender.pages_sent = end
            sender.last_sent = is_last
            sender.state = KVPoll.Transferring
            if self.silent:
                if is_last:
                    self._finish(sender, KVPoll.Success)
                return
            sender.inflight += 1
            chunk = _Chunk(sender, src_pages, start, end, is_last, aux, layers)
        # shard by room so one room's chunks stay in order on one thread
        idx = sender.room % len(self._queues)
        if layers is not None:
            layers.ring_on(self._bells[idx])
        self._queues[idx].put(chunk)

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        with self.lock:
            sender = self.senders.get(room)
            pending = self._pending.pop(room, [])
            if sender is not None:
                self._fail_sender(sender, reason)
                return
        msg = m.AbortRoom(room, reason, tp_rank=self.tp.rank)
        for req, _ in pending:  # the decode side already waits for this room: tell it
            peer = self.decode_peers.get(req.decode_id)
            if peer is not None:
                self.call_soon(lambda e=peer.reg.endpoint: self.send_msg(e, msg))

    # ------------------------------------------------------------ room state
    def _attach(self, sender: KVSender, req: m.RoomRequest) -> None:
        """Give a Bootstrapping sender one decode TP rank's destination; it starts once every decode
        rank that takes heads from this rank sent its own. Call with ``lock`` held."""
        peer = self.decode_peers.get(req.decode_id)
        if sender.peer is None:
            sender.peer, sender.request = peer, req
        if peer is None:
            self._fail_sender(sender, f"destination from unregistered decode {req.decode_id}")
            return
        if peer.reject_reason:
            self._fail_sender(sender, peer.reject_reason)
            return
        reg = peer.reg
        mine = slices_from(self.tp.rank, self.tp.size, reg.tp_size, self.kv_heads)
        slices = [s for s in mine if s.dst_rank == reg.tp_rank]
        if not slices:
            self._fail_sender(sender, f"decode TP rank {reg.tp_rank} of {reg.tp_size} takes no KV heads from "
                                      f"prefill TP rank {self.tp.rank} of {self.tp.size}")
            return
        sender.dests[reg.tp_rank] = _Dest(peer, req, slices)
        if sender.expected is None:
            sender.expected = frozenset(s.dst_rank for s in mine)
        if set(sender.dests) >= sender.expected and sender.state is KVPoll.Bootstrapping:
            sender.state = KVPoll.WaitingForInput

    def _endpoints(self, sender: KVSender) -> list[str]:
        eps = [d.peer.reg.endpoint for d in sender.dests.values()]
        if not eps and sender.peer is not None:
            eps = [sender.peer.reg.endpoint]
        return eps

    def _fail_sender(self, sender: KVSender, reason: str, tell_peer: bool = True, skip: str = "") -> None:
        """Call with ``lock`` held. ``skip``: a decode endpoint that already knows (it aborted the room)."""
        if self._finish(sender, KVPoll.Failed, reason) and tell_peer:
            msg = m.AbortRoom(sender.room, reason, self.endpoint, tp_rank=self.tp.rank)
            for endpoint in self._endpoints(sender):
                if endpoint != skip:
                    self.call_soon(lambda e=endpoint: self.send_msg(e, msg))
        self._maybe_closed(sender)

    def _maybe_closed(self, sender: KVSender, endpoint: str = "") -> None:
        """Call with ``lock`` held: once a failed (or decode-aborted) room has no write queued or in
        flight, tell its decode ranks, which hold the room's pages until then (after any AbortRoom: same queue)."""
        if not (sender.state is KVPoll.Failed or sender.close_wanted) or sender.inflight or sender.close_sent:
            return
        endpoints = set(self._endpoints(sender)) | ({endpoint} if endpoint else set())
        if not endpoints:
            return
        sender.close_sent = True
        msg = m.RoomClosed(sender.room, tp_rank=self.tp.rank)
        for e in endpoints:
            self.call_soon(lambda e=e: self.send_msg(e, msg))

    # --------------------------------------------------------- transfer threads
    def _transfer_loop(self, idx: int) -> None:
        q = self._queues[idx]
        try:
            self._transfer_steps(idx, q)
        finally:
            for sock in self._worker_push[idx].values():
                sock.close(0)

    def _transfer_steps(self, idx: int, q: queue.SimpleQueue) -> None:
        while not self._stop.is_set():
            try:
                chunk = q.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._transfer(idx, chunk)
            except Exception as e:  # noqa: BLE001 - fail the room, keep the thread
                logger.exception("kv prefill: transfer of room %d", chunk.sender.room)
                with self.lock:
                    self._fail_sender(chunk.sender, f"transfer error: {e!r}")
            finally:
                with self.lock:
                    chunk.sender.inflight -= 1
                    self._maybe_closed(chunk.sender)

    def _slice_descriptors(self, chunk: _Chunk, dest: _Dest) -> list[tuple[list[int], list[int], list[int]]]:
        """Per head slice: this rank's heads of the chunk's page runs into one decode TP rank, all layers."""
        peer = dest.peer
        dst_pages = dest.request.dst_pages[chunk.start : chunk.end]
        return [slice_descriptors(chunk.src_pages, dst_pages, self.src_bases, peer.dst_bases, self.head_page_bytes,
                                  self.plane_bytes, peer.plane_bytes, s.src_head, s.dst_head, s.num_heads)
                for s in dest.slices]

    def _descriptors(self, chunk: _Chunk, dest: _Dest) -> tuple[list[int], list[int], list[int]]:
        """This rank's heads of the chunk's page runs, into one decode TP rank (cut by head range if needed)."""
        src, dst, lengths = [], [], []
        for a, b, c in self._slice_descriptors(chunk, dest):
            src += a
            dst += b
            lengths += c
        return src, dst, lengths

    def _layer_descriptors(self, chunk: _Chunk, dest: _Dest) -> list[tuple[list[int], list[int], list[int]]]:
        """``_descriptors`` cut by layer: [num_layers] of (src, dst, lengths)."""
        out: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(self.layout.num_layers)]
        for descs in self._slice_descriptors(chunk, dest):
            for (src, dst, lengths), (a, b, c) in zip(out, split_by_layer(*descs, self.layout.num_layers)):
                src += a
                dst += b
                lengths += c
        return out

    def _transfer(self, idx: int, chunk: _Chunk) -> None:
        sender = chunk.sender
        if sender.state.done:
            return  # aborted while queued
        if chunk.layers is not None:
            self._transfer_layers(idx, chunk)
            return
        if chunk.is_last and chunk.aux is not None:
            self._aux_staging.write(idx, chunk.aux)
        notified: dict[str, bool] = {}
        for dest in list(sender.dests.values()):
            peer = dest.peer
            src, dst, lengths = self._descriptors(chunk, dest)
            kv_bytes = sum(lengths)  # before the aux slot joins them
            notify = None
            if chunk.is_last:
                if chunk.aux is not None and any(s.aux for s in dest.slices):
                    src.append(self._aux_staging.slot_addr(idx))
                    dst.append(peer.reg.aux_addr + dest.request.aux_slot * peer.reg.aux_slot_bytes)
                    lengths.append(self._aux_staging.slot_bytes)
                if self.engine.supports_notifications and src:
                    notify = room_notification(sender.room, self.tp.rank)
            try:
                if src:  # an empty non-last chunk has nothing to write
                    self.engine.write(peer.engine_peer, src, dst, lengths, notify)
            except TransferEngineError as e:
                with self.lock:
                    self._fail_sender(sender, f"KV write of room {sender.room} failed: {e}")
                return
            self.metrics.on_written(sender, kv_bytes)
            notified[peer.reg.endpoint] = notify is not None
        sender.written_at.append(time.monotonic())
        with self.lock:
            if not chunk.is_last or sender.state.done:
                return
            self._finish(sender, KVPoll.Success)
        exposed = time.monotonic() - sender.sent_at[-1]  # since the prefill compute ended (room_metrics.py)
        # straight from this thread (its own socket): one hop less than via the control thread
        for endpoint, notify in notified.items():
            self._push_from_worker(idx, endpoint, m.RoomStatus(sender.room, True, notified=notify, tp_rank=self.tp.rank,
                                                               exposed_s=exposed))

    def _transfer_layers(self, idx: int, chunk: _Chunk) -> None:
        """A chunk whose forward is running: write each layer's pages once the forward stored them,
        several layers in one batch when the link fell behind. Never the last chunk (the aux data
        and the room's success follow in a chunk of their own, after sampling)."""
        sender, signal = chunk.sender, chunk.layers
        num_layers = self.layout.num_layers
        plans = [(dest.peer, self._layer_descriptors(chunk, dest)) for dest in list(sender.dests.values())]
        sent = 0
        while sent < num_layers:
            done = signal.wait_past(sent, self._bells[idx], self._stop)
            if self._stop.is_set():
                return
            if sender.state.done:
                return  # failed or aborted between layers: the layers left are not written
            if done == sent:  # the forward ended without them (it raised)
                with self.lock:
                    self._fail_sender(sender, f"prefill forward of room {sender.room} ended after {done} of "
                                              f"{num_layers} layers")
                return
            for peer, layers in plans:
                src = [a for s, _, _ in layers[sent:done] for a in s]
                dst = [a for _, d, _ in layers[sent:done] for a in d]
                lengths = [n for _, _, ls in layers[sent:done] for n in ls]
                try:
                    if src:
                        self.engine.write(peer.engine_peer, src, dst, lengths)
                except TransferEngineError as e:
                    with self.lock:
                        self._fail_sender(sender, f"KV write of room {sender.room} (layers {sent}-{done - 1}) failed: {e}")
                    return
                self.metrics.on_written(sender, sum(lengths))
            sent = done
        sender.written_at.append(time.monotonic())

    def _push_from_worker(self, idx: int, endpoint: str, msg: m.ControlMessage) -> None:
        socks = self._worker_push[idx]
        sock = socks.get(endpoint)
        if sock is None:
            sock = socks[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{endpoint}")
        try:
            sock.send(self.frame(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kv prefill: control queue to %s full, dropped %s", endpoint, type(msg).__name__)

    # ---------------------------------------------------------- control thread
    def _register_with_bootstrap(self) -> None:
        reg = m.RankRegistration(
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
        )
        deadline = time.monotonic() + max(self.config.bootstrap_timeout, _REGISTER_DEADLINE_S)
        where = f"{self.bootstrap_host}:{self.bootstrap_port}"
        while not self._stop.is_set():
            try:
                register_rank(self.bootstrap_host, self.bootstrap_port, reg, self._bootstrap_auth)
                self.registered.set()
                return
            except urllib.error.HTTPError as e:
                # a 400 will not get better by retrying
                self.registration_error = f"bootstrap server rejected rank: {e.read().decode(errors='replace')}"
                logger.error("kv prefill: %s", self.registration_error)
                self.registered.set()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    self.registration_error = f"bootstrap server {where} unreachable: {e}"
                    logger.error("kv prefill: %s", self.registration_error)
                    self.registered.set()
                    return
                self._stop.wait(0.2)

    def _on_message(self, msg: m.ControlMessage) -> None:
        if isinstance(msg, m.RegisterPool):
            self._on_register_pool(msg)
        elif isinstance(msg, m.RoomRequest):
            self._on_room_request(msg)
        elif isinstance(msg, m.AbortRoom):
            with self.lock:
                self._pending.pop(msg.room, None)
                sender = self.senders.get(msg.room)
                if sender is not None:
                    sender.close_wanted = True
                    # the other decode TP ranks of the room learn it here (and from their own TP group)
                    self._fail_sender(sender, f"aborted by decode: {msg.reason}", skip=msg.endpoint)
                    self._maybe_closed(sender, msg.endpoint)
                    return
                self._aborted_early[msg.room] = (f"aborted by decode: {msg.reason}", self.clock())
            if msg.endpoint:  # a room never started here (or long purged): nothing of it can be in flight
                self.send_msg(msg.endpoint, m.RoomClosed(msg.room, tp_rank=self.tp.rank))
        elif isinstance(msg, m.Heartbeat):
            self.send_msg(msg.endpoint, m.HeartbeatAck(self.id, self.endpoint, msg.seq))
        else:
            logger.warning("kv prefill: unexpected %s", type(msg).__name__)

    def _check_pool(self, reg: m.RegisterPool) -> str | None:
        their_heads = reg.kv_heads or reg.layout.num_kv_heads
        diff = layout_mismatch(self.layout, self.kv_heads, reg.layout, their_heads)
        if diff:
            return diff
        if reg.backend != self.engine.name:
            return f"transfer backend mismatch: prefill {self.engine.name} vs decode {reg.backend}"
        try:
            share = len(kv_head_range(reg.tp_rank, reg.tp_size, their_heads))
        except ValueError as e:
            return f"decode TP rank {reg.tp_rank} of {reg.tp_size}: {e}"
        if share != reg.layout.num_kv_heads:
            return f"decode TP rank {reg.tp_rank} of {reg.tp_size} holds {reg.layout.num_kv_heads} KV heads, not {share}"
        if len(reg.k_addrs) != self.layout.num_layers or len(reg.v_addrs) != self.layout.num_layers:
            return f"decode registered {len(reg.k_addrs)}/{len(reg.v_addrs)} K/V buffers for {self.layout.num_layers} layers"
        if reg.page_bytes != self.head_page_bytes * share:
            return f"page bytes mismatch: prefill {self.page_bytes} for {self.layout.num_kv_heads} heads vs decode {reg.page_bytes} for {share}"
        if reg.num_pages < 2 or reg.aux_num_slots < 1 or reg.aux_slot_bytes != self._aux_staging.slot_bytes:
            return f"bad decode pool: {reg.num_pages} pages, {reg.aux_num_slots} aux slots of {reg.aux_slot_bytes} bytes"
        return None

    def _on_register_pool(self, reg: m.RegisterPool) -> None:
        reason = self._check_pool(reg)
        engine_peer = None
        if reason is None:
            try:
                engine_peer = self.engine.connect(reg.peer_info)
            except TransferEngineError as e:
                reason = str(e)
        peer = DecodePeer(reg, engine_peer, reason, list(reg.k_addrs) + list(reg.v_addrs))
        with self.lock:
            self.decode_peers[reg.decode_id] = peer
        if reason:
            logger.warning("kv prefill: rejected decode %s: %s", reg.decode_id, reason)
        self.send_msg(reg.endpoint, m.RegisterAck(self.id, self.endpoint, reason is None, reason or "", self.engine.peer_info()))

    def _on_room_request(self, req: m.RoomRequest) -> None:
        peer = self.decode_peers.get(req.decode_id)
        if peer is None:
            logger.warning("kv prefill: room %d from unregistered decode %s dropped", req.room, req.decode_id)
            return
        problem = peer.reject_reason
        if problem is None:
            bad = [p for p in req.dst_pages if not 0 < p < peer.reg.num_pages]
            if bad:
                problem = f"destination pages {bad[:4]} outside decode pool [1, {peer.reg.num_pages})"
            elif not 0 <= req.aux_slot < peer.reg.aux_num_slots:
                problem = f"aux slot {req.aux_slot} outside [0, {peer.reg.aux_num_slots})"
        with self.lock:
            sender = self.senders.get(req.room)
            if problem is not None:
                if sender is not None:
                    sender.peer = peer
                    self._fail_sender(sender, problem, tell_peer=False)
                self.send_msg(peer.reg.endpoint, m.AbortRoom(req.room, problem))
                return
            if sender is None:
                self._pending.setdefault(req.room, []).append((req, self.clock()))
            elif sender.state is KVPoll.Bootstrapping:
                self._attach(sender, req)
            elif sender.state is KVPoll.Failed and all(d.peer is not peer for d in sender.dests.values()):
                # the room failed here before this destination came (bootstrap_timeout, an abort):
                # nothing was written to it, so the decode rank learns why and may free it at once
                # instead of waiting its waiting_timeout for KV that will never come
                endpoint = peer.reg.endpoint
                self.send_msg(endpoint, m.AbortRoom(req.room, sender.failure_reason, self.endpoint,
                                                    tp_rank=self.tp.rank))
                self.send_msg(endpoint, m.RoomClosed(req.room, tp_rank=self.tp.rank))
            else:
                logger.warning("kv prefill: duplicate destination for room %d ignored", req.room)

    def _on_timer(self, now: float) -> None:
        timeout = self.config.bootstrap_timeout
        with self.lock:
            for sender in self.senders.values():
                if sender.state is KVPoll.Bootstrapping and now - sender.created > timeout:
                    self._fail_sender(sender, f"no destination from decode within bootstrap_timeout {timeout}s")
            for room in [r for r, reqs in self._pending.items() if now - reqs[0][1] > timeout]:
                del self._pending[room]
            for room in [r for r, (_, at) in self._aborted_early.items() if now - at > timeout]:
                del self._aborted_early[room]
            self._purge(self.senders, now)

    def _close_extra(self) -> None:
        for w in self._workers:
            w.join(timeout=5)
        for bell in self._bells:
            bell.close()
