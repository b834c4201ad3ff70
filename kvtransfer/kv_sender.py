"""Prefill side of one room: polled by the scheduler, advanced by the KV manager's threads."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.kvtransfer.aux_pool import AuxData
from pdserve.kvtransfer.kv_poll import KVPoll

if TYPE_CHECKING:  # torch-free at import, as the rest of the sender's API
    from pdserve.kvtransfer.layer_signal import LayerSignal
from pdserve.kvtransfer.messages import RoomRequest


class SenderManager(Protocol):
    """What a sender needs of its manager (``PrefillKVManager``)."""

    def send_chunk(self, sender: "KVSender", page_indices: list[int], is_last: bool, aux: AuxData | None,
                   layers: LayerSignal | None = None) -> None: ...

    def abort(self, room: int, reason: str) -> None: ...


class KVSender:
    """Bootstrapping (no destination yet) -> WaitingForInput -> Transferring -> Success | Failed."""

    def __init__(self, mgr: SenderManager, room: int, created: float):
        self.room = room
        self._mgr = mgr
        # plain attributes read without a lock (atomic in CPython); written under mgr.lock
        self.state = KVPoll.Bootstrapping
        self.failure_reason: str | None = None
        self.created = created  # on the manager's clock
        self.done_at: float | None = None
        self.peer: Any = None  # the manager's record of the (first) decode peer, once known
        self.request: RoomRequest | None = None  # the first destination (every decode TP rank's has the same pages)
        # the LoRA adapter the room's KV is computed under: (name, lora id); (None, 0): the base model
        self.lora: tuple[str | None, int] = (None, 0)
        # decode TP rank -> its destination; the room starts once every rank expected here sent one
        self.dests: dict[int, Any] = {}
        self.expected: frozenset[int] | None = None
        self.agreed: KVPoll | None = None  # the state the TP ranks agreed on this step (see ``tp_agreement``)
        self.pages_sent = 0
        self.last_sent = False
        self.inflight = 0  # chunks queued or being written on a transfer thread
        self.close_wanted = False  # the decode aborted the room: answer RoomClosed once nothing is in flight
        self.close_sent = False
        # real time (time.monotonic; the manager's clock is for timeouts, and tests move it): each
        # chunk handed over (its compute had ended) and each chunk's writes returned; for /metrics
        # (room_metrics.py) and the request log
        self.sent_at: list[float] = []
        self.written_at: list[float] = []
        self.bytes_sent = 0  # KV bytes written for this room by this rank

    def poll(self) -> KVPoll:
        """Current state (the TP ranks' agreed one, once the loop agreed); cheap, call every scheduler step."""
        return self.state if self.agreed is None else self.agreed

    @property
    def num_dst_pages(self) -> int | None:
        """Pages the decode side allocated for this room, once known."""
        return None if self.request is None else len(self.request.dst_pages)

    @property
    def num_held_pages(self) -> int:
        """Leading prompt pages the decode holds already: not sent (0 until the destination is known)."""
        return 0 if self.request is None else self.request.held_pages

    def send(self, page_indices: Sequence[int], is_last: bool, aux: AuxData | None = None,
             layers: LayerSignal | None = None) -> None:
        """Queue the next chunk of this room's pages (local page indices, in prompt order).

        Valid once ``poll()`` is WaitingForInput or Transferring; ``aux`` goes with the
        last chunk. Returns at once; the write happens on a transfer thread. ``layers``
        (layer-wise send, never with the last chunk): the forward that is about to compute
        these pages; each layer is written as soon as that forward stored it.
        """
        self.sent_at.append(time.monotonic())
        self._mgr.send_chunk(self, list(page_indices), is_last, aux, layers)

    def spans(self, now: float) -> tuple[float | None, float | None]:
        """(transfer latency, exposed time) of a room ending ``now`` (``room_metrics``): since its
        first chunk was handed over, and since its last (the end of its prefill compute)."""
        if not self.sent_at:
            return None, None
        return now - self.sent_at[0], now - self.sent_at[-1]

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._mgr.abort(self.room, reason)

    def __repr__(self) -> str:
        return f"KVSender(room={self.room}, state={self.state.name}, reason={self.failure_reason!r})"
