"""Decode side, first stop of a request: find the prefill rank, then preallocate pages.

Each request gets a KV receiver as soon as its prefill DP rank is known. Once
the receiver is bootstrapped (the prefill rank accepted this pool), pages for
the whole prompt and an aux slot are taken, in arrival order, but only when the
free pages minus the reserve promised to running decodes allow: requests
waiting for KV never starve running decodes of pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.decode.prefill_dp_sizes import PrefillDPSizes
from pdserve.engine.sched.request import Req, ReqStatus
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.kvtransfer import DecodeKVManager, KVPoll, KVReceiver, KVTransferError


@dataclass
class PreallocEntry:
    req: Req
    receiver: KVReceiver | None = None  # None until the prefill DP rank is known


class PreallocQueue:
    def __init__(self, kv: DecodeKVManager, scheduler: Scheduler, dp_sizes: PrefillDPSizes):
        self.kv = kv
        self.scheduler = scheduler
        self.pool = scheduler.pool
        self.dp_sizes = dp_sizes
        self.entries: dict[str, PreallocEntry] = {}  # arrival order

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING_FOR_KV
        self.entries[req.rid] = PreallocEntry(req)

    def remove(self, rid: str) -> PreallocEntry | None:
        return self.entries.pop(rid, None)

    def decode_reserve(self, req: Req) -> int:
        """Pages ``req`` will need for its coming decode steps beyond its prompt."""
        extra = min(req.remaining_new_tokens, self.scheduler.config.num_reserved_decode_tokens)
        return self.pool.pages_for(req.seq_len + 1 + extra) - self.pool.pages_for(req.prompt_len)

    def pop_failed(self) -> list[tuple[Req, str]]:
        """Open receivers where the prefill rank became known; return requests whose room failed."""
        failed = []
        for rid, e in list(self.entries.items()):
            if e.receiver is None:
                boot = e.req.bootstrap
                rank = boot.prefill_dp_rank
                if rank is None:
                    size = self.dp_sizes.get(boot.host, boot.port)
                    if size is None:
                        continue
                    if isinstance(size, str):
                        del self.entries[rid]
                        failed.append((e.req, f"KV transfer failed: {size}"))
                        continue
                    rank = boot.room % size
                try:
                    e.receiver = self.kv.create_receiver(boot.room, boot.host, boot.port, rank)
                except KVTransferError as exc:
                    del self.entries[rid]
                    failed.append((e.req, str(exc)))
                    continue
            if e.receiver.poll() is KVPoll.Failed:
                del self.entries[rid]
                failed.append((e.req, f"KV transfer failed: {e.receiver.failure_reason}"))
        return failed

    def pop_allocated(self, reserved: int, max_new: int) -> list[tuple[Req, KVReceiver]]:
        """Give pages to bootstrapped requests, oldest first, while memory allows.

        ``reserved``: pages promised to requests already decoding or receiving;
        ``max_new``: how many more requests may hold pages (max_running_requests).
        """
        out = []
        for rid, e in list(self.entries.items()):
            if len(out) >= max_new:
                break
            if e.receiver is None or e.receiver.poll() is not KVPoll.WaitingForInput:
                continue  # not bootstrapped yet; later ones may be (different prefill peers)
            req = e.req
            need = self.pool.pages_for(req.prompt_len)
            reserve = self.decode_reserve(req)
            available = self.pool.num_free + self.scheduler.cache.evictable_pages
            alone = not self.scheduler.reqs
            if need + reserve + reserved > available and not (alone and need <= available):
                break  # FIFO: no overtaking, so a large prompt is not starved by small ones
            slot = self.kv.aux_pool.alloc()
            if slot is None:
                break
            pages = self.scheduler.try_alloc(need)
            req.pages = pages
            req.kv_len = 0
            self.scheduler.reqs[req.rid] = req  # the scheduler owns the pages from now on
            e.receiver.init(pages, slot)
            reserved += reserve
            del self.entries[rid]
            out.append((req, e.receiver))
        return out
