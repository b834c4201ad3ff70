"""Decode side, second stop: pages preallocated and sent to prefill, waiting for the KV."""

from __future__ import annotations

from pdserve.engine.sched.request import Req
from pdserve.kvtransfer import KVReceiver


class TransferQueue:
    def __init__(self):
        self.entries: dict[str, tuple[Req, KVReceiver]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def add(self, req: Req, receiver: KVReceiver) -> None:
        self.entries[req.rid] = (req, receiver)

    def reqs(self) -> list[Req]:
        return [req for req, _ in self.entries.values()]

    def pop_done(self) -> list[tuple[Req, KVReceiver]]:
        """Requests whose room ended (``receiver.poll()`` Success or Failed), in arrival order."""
        done = [(req, r) for req, r in self.entries.values() if r.poll().done]
        for req, _ in done:
            del self.entries[req.rid]
        return done

    def remove(self, rid: str) -> tuple[Req, KVReceiver] | None:
        return self.entries.pop(rid, None)
