"""The rooms of one KV manager, and the one way a room ends (the part of the room state machine
that prefill senders and decode receivers share).

Life cycle of a room here: added when the scheduler creates its sender or receiver; moved once to
a terminal state (Success or Failed) by ``finish``; kept ``ROOM_RETENTION_S`` after that, so that
late control messages for it find it and are ignored; then forgotten by ``purge``.

Owns the room table (room -> sender or receiver) and each room's terminal transition (its
``done_at`` and failure reason, and the /metrics count of how it ended). Every method is called
with the manager's ``lock`` held; nothing here sends, sleeps or reads a socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.room_metrics import RoomMetrics

logger = logging.getLogger(__name__)

# terminal rooms are forgotten this long after they ended (late messages for them are ignored)
ROOM_RETENTION_S = 60.0


class Room(Protocol):
    room: int
    state: KVPoll
    failure_reason: str | None
    done_at: float | None


R = TypeVar("R", bound=Room)

# how a room state machine sends: (peer control endpoint, message), queued for the control thread in order
Tell = Callable[[str, m.ControlMessage], None]


class RoomTable(Generic[R]):
    def __init__(self, role: str, metrics: RoomMetrics, clock: Callable[[], float]):
        """``role``: prefill | decode (for the log); ``clock``: the manager's (what ``done_at`` reads)."""
        self.role = role
        self.metrics = metrics
        self.clock = clock
        self.rooms: dict[int, R] = {}

    def get(self, room: int) -> R | None:
        return self.rooms.get(room)

    def add(self, obj: R) -> None:
        """Register a new sender or receiver; a room still open here cannot get a second one."""
        old = self.rooms.get(obj.room)
        if old is not None and not old.state.done:
            raise KVTransferError(f"room {obj.room} already has an open {self._kind}")
        self.rooms[obj.room] = obj

    @property
    def _kind(self) -> str:
        return "sender" if self.role == "prefill" else "receiver"

    def finish(self, obj: R, state: KVPoll, reason: str | None = None) -> bool:
        """Move a room to a terminal state once; False when it already ended."""
        if obj.state.done:
            return False
        if state is KVPoll.Failed:
            obj.failure_reason = reason or "failed"
            logger.info("kv %s: room %d failed: %s", self.role, obj.room, obj.failure_reason)
        self.metrics.on_done(obj, state)  # before the state changes: it counts where a failure happened
        obj.state = state
        obj.done_at = self.clock()
        return True

    def purge(self, now: float) -> None:
        """Forget the rooms that ended more than ``ROOM_RETENTION_S`` ago."""
        for room in [r for r, o in self.rooms.items() if o.done_at is not None and now - o.done_at > ROOM_RETENTION_S]:
            del self.rooms[room]
