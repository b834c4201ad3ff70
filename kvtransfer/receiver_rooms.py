"""The decode rank's room state machine: its receivers, from ``create_receiver`` to their end.

Life cycle of a receiver (SGLang's ``KVPoll``): Bootstrapping while its prefill peer is looked up
and registered (``bind``) -> WaitingForInput once the peer is ready (the scheduler preallocates and
calls ``init``) -> Transferring once the destination was sent to every prefill TP rank it takes
heads from (its sources; ``request``) -> Success once every source reported success (``RoomStatus``)
and every engine notification one of them announced arrived, or Failed from any state (the peer
failed, ``bootstrap_timeout``, ``waiting_timeout``, an abort from either side). After a failure the
room's pages stay quarantined until every source said it has no write of the room left
(``RoomClosed``: ``peer_closed``), or the peer is known dead.

Owns the receiver table, the rooms waiting for notifications, and every state transition. Every
method is called with the manager's ``lock`` held; aborts to prefill ranks leave through ``tell``
(queued for the control thread), a destination is returned for the control thread to send. No
socket, engine or thread here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.kvtransfer.prefill_peers import PrefillPeer
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.room_notification import parse_room_notification
from pdserve.kvtransfer.room_table import RoomTable, Tell

logger = logging.getLogger(__name__)



class ReceiverRooms(RoomTable[KVReceiver]):
    def __init__(self, metrics: RoomMetrics, clock: Callable[[], float], decode_id: str, endpoint: str,
                 num_pages: int, num_aux_slots: int, tell: Tell):
        """``decode_id``/``endpoint``: this rank's id and control endpoint (named in its requests and
        aborts); ``num_pages``/``num_aux_slots``: the pool and aux slots a destination must lie in."""
        super().__init__("decode", metrics, clock)
        self.decode_id = decode_id
        self.endpoint = endpoint
        self.num_pages = num_pages
        self.num_aux_slots = num_aux_slots
        self.tell = tell
        self.awaiting_notify: set[int] = set()  # rooms that wait only for engine notifications

    # ------------------------------------------------------- scheduler thread
    def init(self, receiver: KVReceiver, dst_pages: list[int], aux_slot: int) -> None:
        """The room's destination (sent once the peer is ready). Raises ``KVTransferError`` on a bad one."""
        bad = [p for p in dst_pages if not 0 < p < self.num_pages]
        if bad:
            raise KVTransferError(f"room {receiver.room}: pages {bad[:4]} outside [1, {self.num_pages})")
        if not 0 <= aux_slot < self.num_aux_slots:
            raise KVTransferError(f"room {receiver.room}: aux slot {aux_slot} outside [0, {self.num_aux_slots})")
        if receiver.dst_pages is not None:
            raise KVTransferError(f"room {receiver.room}: init() called twice")
        receiver.dst_pages = dst_pages
        receiver.aux_slot = aux_slot

    def abort(self, room: int, reason: str) -> None:
        receiver = self.get(room)
        if receiver is not None:
            self.fail(receiver, reason)

    # ---------------------------------------------------------- transitions
    def fail(self, receiver: KVReceiver, reason: str, tell_peer: bool = True) -> None:
        """Fail the room and tell every source of it (any thread)."""
        if not self.finish(receiver, KVPoll.Failed, reason):
            return
        self.awaiting_notify.discard(receiver.room)
        peer = receiver.peer
        if tell_peer and peer is not None:
            msg = m.AbortRoom(receiver.room, reason, self.endpoint)
            for endpoint in peer.endpoints:
                self.tell(endpoint, msg)

    def maybe_succeed(self, receiver: KVReceiver) -> None:
        """Success once every source reported success and every notification one of them announced arrived."""
        if receiver.sources <= receiver.ok_from and receiver.notify_from <= receiver.notified_from:
            self.finish(receiver, KVPoll.Success)
            if logger.isEnabledFor(logging.DEBUG):  # the prefill logs its compute end on the same clock
                logger.debug("kv decode: room %d success at %.6f", receiver.room, time.time())
            self.awaiting_notify.discard(receiver.room)
        elif receiver.notify_from - receiver.notified_from:
            self.awaiting_notify.add(receiver.room)

    def bind(self, receiver: KVReceiver, peer: PrefillPeer) -> None:
        """Bind the receiver to its prefill peer; it follows the peer's state."""
        receiver.peer = peer
        peer.receivers.add(receiver.room)
        if peer.state == "failed":
            self.fail(receiver, peer.reason)
        elif peer.state == "ready" and receiver.state is KVPoll.Bootstrapping:
            receiver.state = KVPoll.WaitingForInput

    def request(self, receiver: KVReceiver) -> m.RoomRequest | None:
        """The room's destination, once both it and the peer are ready (Transferring from now on);
        None while one is not (or it was sent already). The caller sends it to every source."""
        peer = receiver.peer
        if (
            peer is None
            or peer.state != "ready"
            or receiver.dst_pages is None
            or receiver.requested_at is not None
            or receiver.state.done
        ):
            return None
        receiver.state = KVPoll.Transferring
        receiver.requested_at = self.clock()
        receiver.sources = peer.sources
        return m.RoomRequest(receiver.room, self.decode_id, receiver.dst_pages, receiver.aux_slot, receiver.held_pages,
                             lora_id=receiver.lora_id)

    def peer_ready(self, peer: PrefillPeer) -> list[KVReceiver]:
        """Every source of ``peer`` accepted this pool: its rooms may take their destinations."""
        ready = [self.rooms[r] for r in peer.receivers if r in self.rooms]
        for receiver in ready:
            if receiver.state is KVPoll.Bootstrapping:
                receiver.state = KVPoll.WaitingForInput
        return ready

    def peer_failed(self, peer: PrefillPeer, reason: str) -> None:
        """Fail every open room of ``peer``."""
        for room in peer.receivers:
            receiver = self.rooms.get(room)
            if receiver is not None:
                # tell the peer even when it looks dead: a prefill that was only stalled
                # (SIGSTOP, a long GC, a congested link) must drop these rooms when it wakes,
                # not compute and send them ahead of new rooms (seen: new rooms then timed out)
                self.fail(receiver, reason, tell_peer=True)
        peer.receivers.clear()

    def peer_gone(self, peer: PrefillPeer) -> int:
        """No write of ``peer`` can land any more: its failed rooms are closed (the decode loop's
        quarantine releases their pages). Returns how many."""
        rooms = [r for r in self.rooms.values() if r.peer is peer and r.state.done and not r.peer_closed]
        for receiver in rooms:
            receiver.peer_closed = True
        return len(rooms)

    def closed_from(self, receiver: KVReceiver, tp_rank: int) -> None:
        """Source ``tp_rank`` has no write of the room left; the room's pages are safe once every
        source said so."""
        receiver.closed_from.add(tp_rank)
        if receiver.sources <= receiver.closed_from:
            receiver.peer_closed = True

    # --------------------------------------------------------- control thread
    def on_status(self, msg: m.RoomStatus) -> None:
        receiver = self.get(msg.room)
        if receiver is None:
            return
        if receiver.state.done:
            # a room failed here that completed there anyway: all its writes have returned
            if msg.success:
                self.closed_from(receiver, msg.tp_rank)
            return
        if not msg.success:
            self.fail(receiver, f"prefill failed: {msg.reason}")
            return
        receiver.ok_from.add(msg.tp_rank)
        receiver.on_status(msg.exposed_s)
        if msg.notified:
            receiver.notify_from.add(msg.tp_rank)
        self.maybe_succeed(receiver)

    def on_closed(self, msg: m.RoomClosed) -> None:
        receiver = self.get(msg.room)
        if receiver is not None:
            self.closed_from(receiver, msg.tp_rank)

    def on_abort(self, msg: m.AbortRoom) -> None:
        receiver = self.get(msg.room)
        if receiver is not None:
            # the other sources (TP ranks) of the room must stop too
            self.fail(receiver, f"aborted by prefill: {msg.reason}")

    def on_notifications(self, notes: Iterable[bytes]) -> None:
        """Engine notifications (``room_notification``) that arrived."""
        for note in notes:
            parsed = parse_room_notification(note)
            receiver = self.get(parsed[0]) if parsed is not None else None
            if receiver is None or receiver.state.done:
                continue
            receiver.notified_from.add(parsed[1])
            if receiver.ok_from:
                self.maybe_succeed(receiver)

    def on_timer(self, now: float, bootstrap_timeout: float, waiting_timeout: float) -> None:
        """Fail the rooms whose peer never got ready, or whose KV never came; forget old rooms."""
        for receiver in self.rooms.values():
            if receiver.state is KVPoll.Bootstrapping and now - receiver.created > bootstrap_timeout:
                detail = receiver.peer.lookup_detail if receiver.peer is not None else ""
                self.fail(receiver, f"prefill not reachable within bootstrap_timeout "
                                    f"{bootstrap_timeout}s{' (' + detail + ')' if detail else ''}")
            elif (
                receiver.state is KVPoll.Transferring
                and receiver.requested_at is not None
                and now - receiver.requested_at > waiting_timeout
            ):
                self.fail(receiver, f"no KV from prefill within waiting_timeout {waiting_timeout}s")
        self.purge(now)

    def is_open(self, room: int) -> bool:
        receiver = self.rooms.get(room)
        return receiver is not None and not receiver.state.done
