"""The prefill rank's room state machine: its senders, from ``create_sender`` to their end.

Life cycle of a sender (SGLang's ``KVPoll``): Bootstrapping until every decode TP rank that takes
heads from this rank sent its destination (``RoomRequest``; one that came before the sender waits
in ``pending``) -> WaitingForInput (the scheduler may run the prefill) -> Transferring (a chunk was
queued: ``start_chunk``) -> Success (the data plane wrote the last chunk) or Failed from any state
(a bad destination, ``bootstrap_timeout``, an abort from either side, a failed write). A failed or
decode-aborted room answers ``RoomClosed`` once no write of it is queued or in flight, so that the
decode rank may reuse its pages. A room the decode aborted before its sender existed is kept in
``aborted_early`` and fails at creation.

Owns the sender table, the early destinations and aborts, and every state transition. Every method
is called with the manager's ``lock`` held; messages to decode ranks leave through ``tell`` (queued
for the control thread, in order), or are returned to the caller where the control thread answers
at once. No socket, engine or thread here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.decode_peers import DecodePeer, DecodePeers
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.head_slices import HeadSlice, TPPlace, slices_from
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.room_table import RoomTable, Tell

logger = logging.getLogger(__name__)



def lora_mismatch(sender: KVSender, req: m.RoomRequest) -> str:
    """Why a room's KV cannot go to a decode that runs it under another LoRA adapter."""
    name, lora_id = sender.lora
    ran = f"LoRA adapter {name!r} (lora id {lora_id})" if lora_id else "the base model (no LoRA adapter)"
    wants = f"lora id {req.lora_id}" if req.lora_id else "the base model"
    return (f"LoRA adapter mismatch: the prefill computed room {sender.room}'s KV under {ran}, the decode "
            f"runs it under {wants}; both servers must load the adapter under the same name from the same path")


@dataclass
class Dest:
    """One decode TP rank's destination of a room, and the head slices this rank writes there."""

    peer: DecodePeer
    request: m.RoomRequest
    slices: list[HeadSlice]


class SenderRooms(RoomTable[KVSender]):
    def __init__(self, metrics: RoomMetrics, clock: Callable[[], float], peers: DecodePeers, tp: TPPlace,
                 kv_heads: int, endpoint: str, tell: Tell):
        """``peers``: the decode ranks registered here; ``tp``/``kv_heads``: this rank's place (which
        heads it writes to whom); ``endpoint``: this rank's control endpoint (named in its aborts)."""
        super().__init__("prefill", metrics, clock)
        self.peers = peers
        self.tp = tp
        self.kv_heads = kv_heads
        # a replica of KV heads a lower TP rank also holds sends nothing (see head_slices)
        self.silent = not slices_from(tp.rank, tp.size, 1, kv_heads)
        self.endpoint = endpoint
        self.tell = tell
        self.pending: dict[int, list[tuple[m.RoomRequest, float]]] = {}  # destinations that came before the sender
        # rooms a decode rank aborted before their sender existed: (reason, when); the sender fails at
        # creation instead of prefilling for nobody and waiting bootstrap_timeout for a destination
        self.aborted_early: dict[int, tuple[str, float]] = {}

    # ------------------------------------------------------- scheduler thread
    def open(self, sender: KVSender) -> None:
        """A new sender: it takes the destinations (or the abort) that came before it."""
        self.add(sender)
        early = self.aborted_early.pop(sender.room, None)
        if early is not None:
            # the decode side knows; its other TP ranks' destinations wait for their own abort
            self.pending.pop(sender.room, None)
            self.fail(sender, early[0], tell_peer=False)
            return
        if self.silent:
            sender.state = KVPoll.WaitingForInput  # nothing to wait for: it follows the others
        for req, _ in self.pending.pop(sender.room, []):
            self.attach(sender, req)

    def start_chunk(self, sender: KVSender, src_pages: list[int], is_last: bool, num_pages: int) -> tuple[int, int] | None:
        """Account a chunk of ``src_pages`` (of a pool of ``num_pages``): the (start, end) of the room's
        destination pages it fills, for the data plane; None when nothing is to be written (the room
        failed, or this rank is silent). Raises ``KVTransferError`` on a misuse by the scheduler."""
        if sender.state is KVPoll.Failed:
            return None  # the scheduler sees Failed on its next poll
        if sender.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            raise KVTransferError(f"room {sender.room}: send() in state {sender.state.name}")
        if sender.last_sent:
            raise KVTransferError(f"room {sender.room}: send() after the last chunk")
        bad = [p for p in src_pages if not 0 < p < num_pages]
        if bad:
            raise KVTransferError(f"room {sender.room}: local pages {bad[:4]} outside [1, {num_pages})")
        start, end = sender.pages_sent, sender.pages_sent + len(src_pages)
        for dest in sender.dests.values():
            got = len(dest.request.dst_pages)
            if end > got or (is_last and end != got):
                self.fail(sender, f"prefill sent {end} pages but decode preallocated {got}")
                return None
        sender.pages_sent = end
        sender.last_sent = is_last
        sender.state = KVPoll.Transferring
        if self.silent:
            if is_last:
                self.finish(sender, KVPoll.Success)
            return None
        sender.inflight += 1
        return start, end

    def abort(self, room: int, reason: str) -> None:
        """The prefill side gives the room up: fail it, or tell the decode ranks already waiting for it."""
        sender = self.get(room)
        pending = self.pending.pop(room, [])
        if sender is not None:
            self.fail(sender, reason)
            return
        msg = m.AbortRoom(room, reason, tp_rank=self.tp.rank)
        for req, _ in pending:  # the decode side already waits for this room: tell it
            peer = self.peers.get(req.decode_id)
            if peer is not None:
                self.tell(peer.reg.endpoint, msg)

    # ---------------------------------------------------------- transitions
    def attach(self, sender: KVSender, req: m.RoomRequest) -> None:
        """Give a Bootstrapping sender one decode TP rank's destination; it starts once every decode
        rank that takes heads from this rank sent its own."""
        peer = self.peers.get(req.decode_id)
        if sender.peer is None:
            sender.peer, sender.request = peer, req
        if peer is None:
            self.fail(sender, f"destination from unregistered decode {req.decode_id}")
            return
        if peer.reject_reason:
            self.fail(sender, peer.reject_reason)
            return
        if req.lora_id != sender.lora[1]:
            self.fail(sender, lora_mismatch(sender, req))
            return
        reg = peer.reg
        mine = slices_from(self.tp.rank, self.tp.size, reg.tp_size, self.kv_heads)
        slices = [s for s in mine if s.dst_rank == reg.tp_rank]
        if not slices:
            self.fail(sender, f"decode TP rank {reg.tp_rank} of {reg.tp_size} takes no KV heads from "
                              f"prefill TP rank {self.tp.rank} of {self.tp.size}")
            return
        sender.dests[reg.tp_rank] = Dest(peer, req, slices)
        if sender.expected is None:
            sender.expected = frozenset(s.dst_rank for s in mine)
        if set(sender.dests) >= sender.expected and sender.state is KVPoll.Bootstrapping:
            sender.state = KVPoll.WaitingForInput

    def endpoints(self, sender: KVSender) -> list[str]:
        """The decode control endpoints that wait for this room."""
        eps = [d.peer.reg.endpoint for d in sender.dests.values()]
        if not eps and sender.peer is not None:
            eps = [sender.peer.reg.endpoint]
        return eps

    def fail(self, sender: KVSender, reason: str, tell_peer: bool = True, skip: str = "") -> None:
        """Fail the room and tell its decode ranks. ``skip``: a decode endpoint that already knows (it
        aborted the room)."""
        if self.finish(sender, KVPoll.Failed, reason) and tell_peer:
            msg = m.AbortRoom(sender.room, reason, self.endpoint, tp_rank=self.tp.rank)
            for endpoint in self.endpoints(sender):
                if endpoint != skip:
                    self.tell(endpoint, msg)
        self.maybe_closed(sender)

    def maybe_closed(self, sender: KVSender, endpoint: str = "") -> None:
        """Once a failed (or decode-aborted) room has no write queued or in flight, tell its decode
        ranks, which hold the room's pages until then (after any AbortRoom: same queue)."""
        if not (sender.state is KVPoll.Failed or sender.close_wanted) or sender.inflight or sender.close_sent:
            return
        endpoints = set(self.endpoints(sender)) | ({endpoint} if endpoint else set())
        if not endpoints:
            return
        sender.close_sent = True
        msg = m.RoomClosed(sender.room, tp_rank=self.tp.rank)
        for e in endpoints:
            self.tell(e, msg)

    def chunk_done(self, sender: KVSender) -> None:
        """The data plane is through with one chunk of the room (written, failed or skipped)."""
        sender.inflight -= 1
        self.maybe_closed(sender)

    def written(self, sender: KVSender) -> bool:
        """The last chunk's writes returned: Success, unless the room ended meanwhile (False then)."""
        return self.finish(sender, KVPoll.Success)

    # --------------------------------------------------------- control thread
    def on_request(self, req: m.RoomRequest, peer: DecodePeer, problem: str | None) -> list[tuple[str, m.ControlMessage]]:
        """A decode TP rank's destination (``problem``: why it cannot be written). Returns what the
        control thread answers at once: [(endpoint, message)]."""
        sender = self.get(req.room)
        if problem is not None:
            if sender is not None:
                sender.peer = peer
                self.fail(sender, problem, tell_peer=False)
            return [(peer.reg.endpoint, m.AbortRoom(req.room, problem))]
        if sender is None:
            self.pending.setdefault(req.room, []).append((req, self.clock()))
        elif sender.state is KVPoll.Bootstrapping:
            self.attach(sender, req)
        elif sender.state is KVPoll.Failed and all(d.peer is not peer for d in sender.dests.values()):
            # the room failed here before this destination came (bootstrap_timeout, an abort):
            # nothing was written to it, so the decode rank learns why and may free it at once
            # instead of waiting its waiting_timeout for KV that will never come
            endpoint = peer.reg.endpoint
            return [(endpoint, m.AbortRoom(req.room, sender.failure_reason, self.endpoint, tp_rank=self.tp.rank)),
                    (endpoint, m.RoomClosed(req.room, tp_rank=self.tp.rank))]
        else:
            logger.warning("kv prefill: duplicate destination for room %d ignored", req.room)
        return []

    def on_abort(self, msg: m.AbortRoom) -> bool:
        """A decode rank aborted the room. True: no sender of it exists here, so nothing of it can be in
        flight (the caller answers ``RoomClosed`` at once)."""
        self.pending.pop(msg.room, None)
        sender = self.get(msg.room)
        if sender is not None:
            sender.close_wanted = True
            # the other decode TP ranks of the room learn it here (and from their own TP group)
            self.fail(sender, f"aborted by decode: {msg.reason}", skip=msg.endpoint)
            self.maybe_closed(sender, msg.endpoint)
            return False
        self.aborted_early[msg.room] = (f"aborted by decode: {msg.reason}", self.clock())
        return True

    def on_timer(self, now: float, bootstrap_timeout: float) -> None:
        """Fail the rooms no destination came for; forget stale early destinations and aborts."""
        for sender in self.rooms.values():
            if sender.state is KVPoll.Bootstrapping and now - sender.created > bootstrap_timeout:
                self.fail(sender, f"no destination from decode within bootstrap_timeout {bootstrap_timeout}s")
        for room in [r for r, reqs in self.pending.items() if now - reqs[0][1] > bootstrap_timeout]:
            del self.pending[room]
        for room in [r for r, (_, at) in self.aborted_early.items() if now - at > bootstrap_timeout]:
            del self.aborted_early[room]
        self.purge(now)
