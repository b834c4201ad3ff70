"""Decode side: pages and aux slots of rooms that failed while the prefill may still write them.

A room that fails (heartbeat, waiting timeout, abort) after its destination went to the prefill
can still have KV writes queued or in flight there; they land whenever the link lets them, so
its pages must not go to another request before the prefill says the room is closed
(``RoomClosed``, or the ``RoomStatus`` of a room that completed anyway) or ``timeout`` passed.
A prefill that died cannot say it: once it is known dead (heartbeat failed, bootstrap registration
gone) and the transfer engine tore its connection down, ``DecodeKVManager`` closes its rooms
(``peer_closed``) itself; the timeout stays for a prefill that is merely silent.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvtransfer import KVReceiver


@dataclass
class _Held:
    receiver: KVReceiver
    pages: list[int]
    aux_slot: int | None
    deadline: float


class Quarantine:
    def __init__(self, timeout: float, pages: set[int] | None = None):
        """``pages``: the set to keep every held page in (the scheduler's ``held_pages``)."""
        self.timeout = timeout
        self.pages: set[int] = set() if pages is None else pages
        self.entries: list[_Held] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_pages(self) -> int:
        return sum(len(h.pages) for h in self.entries)

    @property
    def aux_slots(self) -> int:
        return sum(h.aux_slot is not None for h in self.entries)

    def hold(self, receiver: KVReceiver, pages: list[int], aux_slot: int | None, now: float) -> None:
        """Keep ``pages`` and ``aux_slot`` of ``receiver``'s room until its prefill closed it or ``timeout``."""
        self.entries.append(_Held(receiver, list(pages), aux_slot, now + self.timeout))
        self.pages.update(pages)

    def pop_released(self, now: float) -> list[tuple[list[int], int | None, bool]]:
        """``(pages, aux_slot, timed_out)`` of each room now safe to reuse."""
        out, keep = [], []
        for h in self.entries:
            closed = h.receiver.peer_closed
            if closed or now >= h.deadline:
                self.pages.difference_update(h.pages)
                out.append((h.pages, h.aux_slot, not closed))
            else:
                keep.append(h)
        self.entries = keep
        return out
