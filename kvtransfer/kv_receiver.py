"""Decode side of one room: polled by the scheduler, advanced by the KV manager's control thread."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.kvtransfer.aux_pool import AuxData
from pdserve.kvtransfer.kv_poll import KVPoll

if TYPE_CHECKING:
    from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager, PrefillPeer


class KVReceiver:
    """Bootstrapping (finding and registering with the prefill rank) -> WaitingForInput
    (ready for ``init``) -> Transferring (destination sent) -> Success | Failed."""

    def __init__(self, mgr: "DecodeKVManager", room: int, peer_key: tuple[str, int, int]):
        self.room = room
        self._mgr = mgr
        self.peer_key = peer_key  # (bootstrap_host, bootstrap_port, prefill_dp_rank)
        self.state = KVPoll.Bootstrapping
        self.failure_reason: str | None = None
        self.created = time.monotonic()
        self.done_at: float | None = None
        self.peer: "PrefillPeer | None" = None
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
        self._mgr._init(self, list(dst_page_indices), aux_slot)

    def aux(self) -> AuxData | None:
        """The first output token and logprobs, once ``poll()`` is Success."""
        if self.state is not KVPoll.Success or self.aux_slot is None:
            return None
        return self._mgr.aux_pool.read(self.aux_slot)

    def abort(self, reason: str = "aborted by decode") -> None:
        self._mgr.abort(self.room, reason)

    def __repr__(self) -> str:
        return f"KVReceiver(room={self.room}, state={self.state.name}, reason={self.failure_reason!r})"
