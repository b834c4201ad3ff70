"""The prefill rank's data plane: its transfer threads write each room's KV pages and aux data
straight into the decode ranks' pools through the transfer engine.

Life cycle of a chunk (SGLang's transfer queue and transfer worker): the manager queues it
(``submit``) on the thread its room is sharded to, so one room's chunks stay in order; the thread
turns the chunk's page runs into descriptors (this rank's head slices of every layer's K and V,
contiguous runs coalesced, ``page_runs``) and writes them. A whole chunk is one batch per decode TP
rank; the last one carries the aux slot (first token, logprobs) and, where the engine has them, a
per-room notification, and its ``RoomStatus`` goes from this thread straight to each decode rank.
A layer-wise chunk (``LayerSignal``) is written layer by layer as its forward stores them.

Owns the transfer threads and their queues, doorbells and per-thread sockets, the aux staging slots,
and the descriptor arithmetic. What a write means for the room (Success, Failed, a chunk done) goes
back through ``RoomOutcome``: the room state machine decides.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.aux_pool import AuxData, AuxPool
from pdserve.kvtransfer.errors import TransferEngineError
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.layer_signal import Doorbell, LayerSignal
from pdserve.kvtransfer.page_runs import slice_descriptors, split_by_layer
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.room_notification import room_notification
from pdserve.kvtransfer.sender_rooms import Dest
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

Descriptors = tuple[list[int], list[int], list[int]]  # (src addresses, dst addresses, lengths)


@dataclass(frozen=True)
class SourcePool:
    """This rank's KV pool as the descriptors see it (head-major, ``page_pool``)."""

    bases: list[int]  # every layer's K buffer, then every layer's V buffer (none in a latent pool)
    head_page_bytes: int  # one head's page
    plane_bytes: int  # one head's pages: the stride between heads
    num_layers: int


@dataclass
class Chunk:
    sender: KVSender
    src_pages: list[int]
    start: int  # the chunk's pages are the destinations' dst_pages[start:end]
    end: int
    is_last: bool
    aux: AuxData | None
    # layer-wise: the step computing these pages; each layer is written once the forward stored it
    layers: LayerSignal | None = None


def slice_runs(src: SourcePool, chunk: Chunk, dest: Dest) -> list[Descriptors]:
    """Per head slice: this rank's heads of the chunk's page runs into one decode TP rank, all layers."""
    peer = dest.peer
    dst_pages = dest.request.dst_pages[chunk.start : chunk.end]
    return [slice_descriptors(chunk.src_pages, dst_pages, src.bases, peer.dst_bases, src.head_page_bytes,
                              src.plane_bytes, peer.plane_bytes, s.src_head, s.dst_head, s.num_heads)
            for s in dest.slices]


def chunk_descriptors(src: SourcePool, chunk: Chunk, dest: Dest) -> Descriptors:
    """This rank's heads of the chunk's page runs, into one decode TP rank (cut by head range if needed)."""
    out: Descriptors = ([], [], [])
    for a, b, c in slice_runs(src, chunk, dest):
        out[0].extend(a)
        out[1].extend(b)
        out[2].extend(c)
    return out


def layer_descriptors(src: SourcePool, chunk: Chunk, dest: Dest) -> list[Descriptors]:
    """``chunk_descriptors`` cut by layer: [num_layers] of (src, dst, lengths)."""
    out: list[Descriptors] = [([], [], []) for _ in range(src.num_layers)]
    for descs in slice_runs(src, chunk, dest):
        for (s, d, n), (a, b, c) in zip(out, split_by_layer(*descs, src.num_layers, len(src.bases) // src.num_layers)):
            s.extend(a)
            d.extend(b)
            n.extend(c)
    return out


class RoomOutcome(Protocol):
    """What the writer reports to the room state machine (each takes the manager's lock)."""

    def write_failed(self, sender: KVSender, reason: str) -> None: ...

    def room_written(self, sender: KVSender) -> bool:
        """The last chunk's writes returned: True when the room succeeded now (then tell decode)."""

    def chunk_done(self, sender: KVSender) -> None: ...


class KVWriter:
    def __init__(self, engine: TransferEngine, src: SourcePool, num_threads: int, aux_max_top_logprobs: int,
                 tp_rank: int, metrics: RoomMetrics, outcome: RoomOutcome, ctx: zmq.Context,
                 frame: Callable[[m.ControlMessage, str], bytes], stop: threading.Event, aux_hidden_bytes: int = 0):
        """``frame``: a control message as it goes on the wire (sealed); ``stop``: set when the manager
        closes (the threads end). The aux staging slots must be registered with ``engine`` by the
        caller (``staging.base_addr``, ``staging.nbytes``). ``aux_hidden_bytes``: the hidden state
        a room's aux data carries for a NEXTN decode (0: none)."""
        self.engine = engine
        self.src = src
        self.tp_rank = tp_rank
        self.metrics = metrics
        self.outcome = outcome
        self._ctx = ctx
        self._frame = frame
        self._stop = stop
        # one staging aux slot per transfer thread: a thread has one room's aux in flight at a time
        self.staging = AuxPool(num_threads, aux_max_top_logprobs, aux_hidden_bytes)
        self._queues: list[queue.SimpleQueue[Chunk]] = [queue.SimpleQueue() for _ in range(num_threads)]
        # layer-wise: what each transfer thread sleeps on while the forward of its chunk runs
        self._bells = [Doorbell() for _ in range(num_threads)]
        # ZMQ sockets are single-thread: each transfer thread owns its own, per decode endpoint
        self._push: list[dict[str, zmq.Socket]] = [{} for _ in range(num_threads)]
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"kv-transfer-{i}", daemon=True)
                         for i in range(num_threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, chunk: Chunk) -> None:
        """Queue a chunk (from the scheduler thread); shard by room so one room's chunks stay in order."""
        idx = chunk.sender.room % len(self._queues)
        if chunk.layers is not None:
            chunk.layers.ring_on(self._bells[idx])
        self._queues[idx].put(chunk)

    def close(self) -> None:
        """After ``stop`` is set: wait for the threads and close the doorbells."""
        for t in self._threads:
            t.join(timeout=5)
        for bell in self._bells:
            bell.close()

    # --------------------------------------------------------- transfer threads
    def _loop(self, idx: int) -> None:
        try:
            self._steps(idx, self._queues[idx])
        finally:
            for sock in self._push[idx].values():
                sock.close(0)

    def _steps(self, idx: int, q: queue.SimpleQueue) -> None:
        while not self._stop.is_set():
            try:
                chunk = q.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._transfer(idx, chunk)
            except Exception as e:  # noqa: BLE001 - fail the room, keep the thread
                logger.exception("kv prefill: transfer of room %d", chunk.sender.room)
                self.outcome.write_failed(chunk.sender, f"transfer error: {e!r}")
            finally:
                self.outcome.chunk_done(chunk.sender)

    def _transfer(self, idx: int, chunk: Chunk) -> None:
        sender = chunk.sender
        if sender.state.done:
            return  # aborted while queued
        if chunk.layers is not None:
            self._transfer_layers(idx, chunk)
            return
        if chunk.is_last and chunk.aux is not None:
            self.staging.write(idx, chunk.aux)
        notified: dict[str, bool] = {}
        for dest in list(sender.dests.values()):
            peer = dest.peer
            src, dst, lengths = chunk_descriptors(self.src, chunk, dest)
            kv_bytes = sum(lengths)  # before the aux slot joins them
            notify = None
            if chunk.is_last:
                if chunk.aux is not None and any(s.aux for s in dest.slices):
                    src.append(self.staging.slot_addr(idx))
                    dst.append(peer.reg.aux_addr + dest.request.aux_slot * peer.reg.aux_slot_bytes)
                    lengths.append(self.aux_write_bytes(peer.reg.aux_slot_bytes, chunk.aux))
                if self.engine.supports_notifications and src:
                    notify = room_notification(sender.room, self.tp_rank)
            try:
                if src:  # an empty non-last chunk has nothing to write
                    self.engine.write(peer.engine_peer, src, dst, lengths, notify)
            except TransferEngineError as e:
                self.outcome.write_failed(sender, f"KV write of room {sender.room} failed: {e}")
                return
            self.metrics.on_written(sender, kv_bytes)
            notified[peer.reg.endpoint] = notify is not None
        sender.written_at.append(time.monotonic())
        if not chunk.is_last or not self.outcome.room_written(sender):
            return
        exposed = time.monotonic() - sender.sent_at[-1]  # since the prefill compute ended (room_metrics.py)
        # straight from this thread (its own socket): one hop less than via the control thread
        for endpoint, notify in notified.items():
            self._push_status(idx, endpoint, m.RoomStatus(sender.room, True, notified=notify, tp_rank=self.tp_rank,
                                                          exposed_s=exposed))

    def aux_write_bytes(self, dst_slot_bytes: int, aux: AuxData) -> int:
        """How much of the staging slot goes into a decode slot of ``dst_slot_bytes``: all of it
        where that slot holds the hidden state this one carries, else the part before it (a decode
        that does not draft with NEXTN; ``DecodePeers.check_pool`` refused any other size)."""
        if aux.hidden and dst_slot_bytes == self.staging.slot_bytes:
            return self.staging.slot_bytes
        return self.staging.base_bytes

    def _transfer_layers(self, idx: int, chunk: Chunk) -> None:
        """A chunk whose forward is running: write each layer's pages once the forward stored them,
        several layers in one batch when the link fell behind. Never the last chunk (the aux data
        and the room's success follow in a chunk of their own, after sampling)."""
        sender, signal = chunk.sender, chunk.layers
        num_layers = self.src.num_layers
        plans = [(dest.peer, layer_descriptors(self.src, chunk, dest)) for dest in list(sender.dests.values())]
        sent = 0
        while sent < num_layers:
            done = signal.wait_past(sent, self._bells[idx], self._stop)
            if self._stop.is_set():
                return
            if sender.state.done:
                return  # failed or aborted between layers: the layers left are not written
            if done == sent:  # the forward ended without them (it raised)
                self.outcome.write_failed(sender, f"prefill forward of room {sender.room} ended after {done} of "
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
                    self.outcome.write_failed(sender, f"KV write of room {sender.room} (layers {sent}-{done - 1}) "
                                                      f"failed: {e}")
                    return
                self.metrics.on_written(sender, sum(lengths))
            sent = done
        sender.written_at.append(time.monotonic())

    def _push_status(self, idx: int, endpoint: str, msg: m.ControlMessage) -> None:
        socks = self._push[idx]
        sock = socks.get(endpoint)
        if sock is None:
            sock = socks[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{endpoint}")
        try:
            sock.send(self._frame(msg, endpoint), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kv prefill: control queue to %s full, dropped %s", endpoint, type(msg).__name__)
