"""Decode side of one room: polled by the scheduler, advanced by the KV manager's control thread."""

from __future__ import annotations

import time
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
        self.held_pages = 0  # leading prompt pages the decode holds already (RoomRequest.held_pages)
        self.lora_id = 0  # the adapter the decode runs the room under (RoomRequest.lora_id)
        self.requested_at: float | None = None
        # the prefill has no write of this room queued or in flight any more (RoomClosed, or its RoomStatus)
        self.closed_here = False
        # tensor parallel: the prefill TP ranks this rank's heads come from, and what each reported
        self.sources: frozenset[int] = frozenset({0})
        self.ok_from: set[int] = set()  # RoomStatus success
        self.notify_from: set[int] = set()  # said an engine notification follows
        self.notified_from: set[int] = set()  # whose notification arrived
        self.closed_from: set[int] = set()  # RoomClosed (or success after this room failed here)
        # what the TP ranks agreed on this step (see ``tp_agreement``); None: this rank's own view
        self.agreed: KVPoll | None = None
        self.agreed_closed: bool | None = None
        # real time (time.monotonic, as the sender's), for /metrics (room_metrics.py): when the
        # destination was handed over, when the last RoomStatus arrived, and the exposed time the
        # prefill measured up to sending it (the longest of the TP sources)
        self.init_at: float | None = None
        self.status_at: float | None = None
        self.prefill_exposed = 0.0

    @property
    def peer_closed(self) -> bool:
        return self.closed_here if self.agreed_closed is None else self.agreed_closed

    @peer_closed.setter
    def peer_closed(self, value: bool) -> None:
        self.closed_here = value

    def poll(self) -> KVPoll:
        """Current state (the TP ranks' agreed one, once the loop agreed); cheap, call every scheduler step."""
        return self.state if self.agreed is None else self.agreed

    def init(self, dst_page_indices: Sequence[int], aux_slot: int) -> None:
        """Give the pages (and aux slot) preallocated for this room; sent once the peer is ready."""
        self.init_at = time.monotonic()
        self._mgr.init_receiver(self, list(dst_page_indices), aux_slot)

    def on_status(self, exposed_s: float) -> None:
        """A prefill source reported success, ``exposed_s`` after its compute of the room ended."""
        self.status_at = time.monotonic()
        self.prefill_exposed = max(self.prefill_exposed, exposed_s)

    def spans(self, now: float) -> tuple[float | None, float | None]:
        """(transfer latency, exposed time) of a room succeeding ``now`` (``room_metrics``)."""
        if self.init_at is None or self.status_at is None:
            return None, None
        return now - self.init_at, self.prefill_exposed + (now - self.status_at)

    def aux(self) -> AuxData | None:
        """The first output token and logprobs, once ``poll()`` is Success."""
        if self.poll() is not KVPoll.Success or self.aux_slot is None:
            return None
        return self._mgr.aux_pool.read(self.aux_slot)

    def abort(self, reason: str = "aborted by decode") -> None:
        self._mgr.abort(self.room, reason)

    def __repr__(self) -> str:
        return f"KVReceiver(room={self.room}, state={self.state.name}, reason={self.failure_reason!r})"
