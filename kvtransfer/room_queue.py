"""Requests waiting for their room to end: on the prefill side after the last chunk was
queued (the transfer threads still read the pages), on the decode side after the destination
was sent (the prefill writes into the pages). Either way the request holds its pages until
its sender or receiver is Success or Failed."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class _HasRid(Protocol):
    rid: str


class _Room(Protocol):
    def poll(self): ...


R = TypeVar("R", bound=_HasRid)
E = TypeVar("E", bound=_Room)


class RoomQueue(Generic[R, E]):
    def __init__(self):
        self.entries: dict[str, tuple[R, E]] = {}  # rid -> (request, its sender or receiver), arrival order

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def add(self, req: R, room: E) -> None:
        self.entries[req.rid] = (req, room)

    def reqs(self) -> list[R]:
        return [req for req, _ in self.entries.values()]

    def pop_done(self) -> list[tuple[R, E]]:
        """Requests whose room ended (``poll()`` Success or Failed), in arrival order."""
        done = [(req, r) for req, r in self.entries.values() if r.poll().done]
        for req, _ in done:
            del self.entries[req.rid]
        return done

    def remove(self, rid: str) -> tuple[R, E] | None:
        return self.entries.pop(rid, None)
