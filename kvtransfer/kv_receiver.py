"""Decode side of one room: polled by the scheduler, advanced by the KV manager's control thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pdserve.kvtransfer.aux_pool import AuxData, AuxPool
from pdserve.kvtransfer.kv_poll import KVPoll


class ReceiverManager(Protocol):
    """What a receiver needs of its manager (``DecodeKVManager``)."""

    aux_pool: AuxPool

    def init_receiver(self, receiver: "KVReceiver", dst_page_indices: list[int], aux_slot: int) -> None: ...

    def abort(self, room: int, reason: str) -> None: ...


class KVReceiver:
    """Bootstrapping (finding and registering with the prefill rank) -> WaitingForInput
    (ready for ``init``) -> Transferring (destination sent) -> Success | Failed."""

    def __init__(self, mgr: ReceiverManager, room: int, peer_key: tuple[str, int, int], created: float):
        self.room = room
        self._mgr = mgr
        self.peer_key = peer_key  # (bootstrap_host, bootstrap_port, prefill_dp_rank)
        self.state = KVPoll.Bootstrapping
        self.failure_reason: str | None = None
        self.created = created  # on the manager's clock
        self.done_at: float | None = None
        self.peer: Any = None  # the manager's record of the prefill peer, once attached
        self.dst_pages: list[int] | None = None
        self.aux_slot: int | None = None
        self.requested_at: float | None = None
        self.status_ok = False  # prefill said success
        self.notified = False  # the engine's per-room notification arrived (nixl)
        self.need_notify = False
        # the prefill has no write of this room queued or in flight any more (RoomClosed, or its RoomStatus)
        self.peer_closed = False

    def poll(self) -> KVPoll:
        """Current state; cheap, call every scheduler step."""
        return self.state

    def init(self, dst_page_indices: Sequence[int], aux_slot: int) -> None:
        """Give the pages (and aux slot) preallocated for this room; sent once the peer is ready."""
        self._mgr.init_receiver(self, list(dst_page_indices), aux_slot)

    def aux(self) -> AuxData | None:
        """The first output token and logprobs, once ``poll()`` is Success."""
        if self.state is not KVPoll.Success or self.aux_slot is None:
            return None
        return self._mgr.aux_pool.read(self.aux_slot)

    def abort(self, reason: str = "aborted by decode") -> None:
        self._mgr.abort(self.room, reason)

    def __repr__(self) -> str:
        return f"KVReceiver(room={self.room}, state={self.state.name}, reason={self.failure_reason!r})"
