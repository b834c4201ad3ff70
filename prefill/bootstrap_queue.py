"""Prefill side, first stop of a request: a KV sender per room, waiting for the decode side.

A request leaves this queue once its sender has the decode rank's destination
(``WaitingForInput``): only then is it worth prefilling, since the KV has a
place to go. A sender that fails here (bootstrap timeout, aborted by decode, a
destination of the wrong size) ends its request before any compute.
"""

from __future__ import annotations

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.sched.request import Req, ReqStatus
from pdserve.kvtransfer import KVPoll, KVSender, KVTransferError, PrefillKVManager


class BootstrapQueue:
    def __init__(self, kv: PrefillKVManager, pool: PagePool):
        self.kv = kv
        self.pool = pool
        self.entries: dict[str, tuple[Req, KVSender]] = {}  # insertion order = arrival order

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def add(self, req: Req) -> str | None:
        """Open the room's sender; returns an error message if the room cannot be opened."""
        try:
            sender = self.kv.create_sender(req.bootstrap.room, (req.lora_name, req.lora_id))
        except KVTransferError as e:
            return str(e)
        req.status = ReqStatus.WAITING_FOR_BOOTSTRAP
        self.entries[req.rid] = (req, sender)
        return None

    def abort_mismatched(self) -> None:
        """Abort rooms whose decode preallocated the wrong number of pages (before the TP ranks agree,
        so a rank that has no destination to check, a silent replica, fails the room with the others)."""
        for req, sender in self.entries.values():
            got = sender.num_dst_pages
            if sender.state is KVPoll.WaitingForInput and got is not None:
                total, held = self.pool.pages_for(req.prompt_len), sender.num_held_pages
                want = total - held
                if held < 0 or held >= total:
                    sender.abort(f"decode holds {held} pages of a {req.prompt_len}-token prompt")
                elif got != want:
                    sender.abort(f"decode preallocated {got} pages for a {req.prompt_len}-token prompt that needs {want}")

    def senders(self) -> list[KVSender]:
        return [sender for _, sender in self.entries.values()]

    def pop_ready(self) -> tuple[list[tuple[Req, KVSender]], list[tuple[Req, str]]]:
        """Requests whose destination arrived (to prefill), and requests whose room failed."""
        ready, failed = [], []
        for rid, (req, sender) in list(self.entries.items()):
            state = sender.poll()
            if state is KVPoll.Bootstrapping:
                continue
            del self.entries[rid]
            if state is KVPoll.Failed:
                failed.append((req, f"KV transfer failed: {sender.failure_reason}"))
                continue
            ready.append((req, sender))
        return ready, failed

    def remove(self, rid: str) -> tuple[Req, KVSender] | None:
        return self.entries.pop(rid, None)
