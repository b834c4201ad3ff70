"""Prefill side, last stop of a request: its last KV chunk is queued, its pages are held
until the transfer ends (the transfer threads read them)."""

from __future__ import annotations

from pdserve.engine.sched.request import Req
from pdserve.kvtransfer import KVSender


class InflightQueue:
    def __init__(self):
        self.entries: dict[str, tuple[Req, KVSender]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def add(self, req: Req, sender: KVSender) -> None:
        self.entries[req.rid] = (req, sender)

    def pop_done(self) -> list[tuple[Req, KVSender]]:
        """Requests whose transfer ended (``sender.poll()`` is Success or Failed)."""
        done = [(req, s) for req, s in self.entries.values() if s.poll().done]
        for req, _ in done:
            del self.entries[req.rid]
        return done

    def remove(self, rid: str) -> tuple[Req, KVSender] | None:
        return self.entries.pop(rid, None)
