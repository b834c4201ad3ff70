"""Decode side, first stop of a request: find the prefill rank, then preallocate pages.

Each request gets a KV receiver as soon as its prefill DP rank is known. Once
the receiver is bootstrapped (the prefill rank accepted this pool), pages for
the whole prompt and an aux slot are taken, in arrival order, but only when the
free pages minus the reserve promised to running decodes allow: requests
waiting for KV never starve running decodes of pages.

With ``enable_priority_scheduling`` the order is by priority, then arrival, and a request short of
pages preempts running decodes of lower priority (``Scheduler.preempt_for``): they rejoin the
scheduler's waiting queue and resume by a local prefill of prompt plus output so far, as a
retracted request does.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sched.priority_order import priority_rank
from pdserve.engine.sched.request import Req, ReqStatus
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.engine.model_executor.parallel import tp_size
from pdserve.kvtransfer.tp_agreement import hold_new


@dataclass
class PreallocEntry:
    req: Req
    receiver: KVReceiver | None = None  # None until the prefill DP rank is known


class PreallocQueue:
    def __init__(self, kv: DecodeKVManager, scheduler: Scheduler):
        self.kv = kv
        self.scheduler = scheduler
        self.pool = scheduler.pool
        self.entries: dict[str, PreallocEntry] = {}  # arrival order
        # with TP > 1 the ranks' caches may differ (``_match``); the TP group is set up before the loop
        self.match_cache = tp_size() == 1

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING_FOR_KV
        self.entries[req.rid] = PreallocEntry(req)

    def remove(self, rid: str) -> PreallocEntry | None:
        return self.entries.pop(rid, None)

    def unresolved(self) -> list[PreallocEntry]:
        """Entries whose prefill DP rank is still to be learnt from the prefill server's DP size."""
        return [e for e in self.entries.values() if e.receiver is None and e.req.bootstrap.prefill_dp_rank is None]

    def receivers(self) -> list[KVReceiver]:
        return [e.receiver for e in self.entries.values() if e.receiver is not None]

    def pop_failed(self, dp_sizes: dict[str, int | str]) -> list[tuple[Req, str]]:
        """Open receivers where the prefill rank became known; return requests whose room failed.

        ``dp_sizes``: for ``unresolved`` entries, by rid, their prefill server's DP size or why it is
        not known (a missing rid: not known yet)."""
        failed = []
        for rid, e in list(self.entries.items()):
            if e.receiver is None:
                boot = e.req.bootstrap
                rank = boot.prefill_dp_rank
                if rank is None:
                    size = dp_sizes.get(rid)
                    if size is None:
                        continue
                    if isinstance(size, str):
                        del self.entries[rid]
                        failed.append((e.req, f"KV transfer failed: {size}"))
                        continue
                    rank = boot.room % size
                try:
                    e.receiver = self.kv.create_receiver(boot.room, boot.host, boot.port, rank, e.req.lora_id)
                except KVTransferError as exc:
                    del self.entries[rid]
                    failed.append((e.req, str(exc)))
                    continue
                hold_new(e.receiver)
            if e.receiver.poll() is KVPoll.Failed:
                del self.entries[rid]
                failed.append((e.req, f"KV transfer failed: {e.receiver.failure_reason}"))
        return failed

    def _match(self, req: Req) -> tuple[list[int], object]:
        """The prompt's leading pages this decode's prefix cache holds (locked), all but the last
        page at least, so the prefill sends one or more (with TP > 1 none: the ranks' caches may
        differ, and each would ask its prefill ranks for a different split)."""
        s = self.scheduler
        if not self.match_cache:
            return [], None
        limit = (req.prompt_len - 1) // self.pool.page_size * self.pool.page_size
        cached, node = s.cache.match_prefix(req.cache_key(limit))  # in the namespace of its adapter
        s.cache.lock(node)
        return cached, node

    def pop_allocated(self, promised: int, max_new: int) -> list[tuple[Req, KVReceiver]]:
        """Give pages to bootstrapped requests, oldest first, while the scheduler's admission rule allows.

        ``promised``: the reserve of requests already decoding or receiving
        (``Scheduler.promised_pages``); ``max_new``: how many more requests may hold
        pages (max_running_requests).
        """
        out = []
        s = self.scheduler
        entries = list(self.entries.items())
        if s.config.enable_priority_scheduling:  # a stable sort: arrival order within a priority
            low_first = s.config.schedule_low_priority_values_first
            entries.sort(key=lambda item: priority_rank(item[1].req.priority, low_first))
        for rid, e in entries:
            if e.receiver is None or e.receiver.poll() is not KVPoll.WaitingForInput:
                continue  # not bootstrapped yet; later ones may be (different prefill peers)
            req = e.req
            if len(out) >= max_new:  # every running slot is taken
                released = s.preempt_for(req, 0, need_slot=True)
                if released is None:
                    break
                promised -= released
                max_new += 1
            total = self.pool.pages_for(req.prompt_len)
            cached, node = self._match(req)
            need = total - len(cached)
            # it decodes from one token past its prompt (the first token comes with the KV)
            reserve = s.reserve_pages(req, req.seq_len + 1) - total
            if not s.fits(need, reserve, promised, alone=not s.reqs):
                s.cache.unlock(node)
                released = s.preempt_for(req, need + reserve + promised - s.free_pages())
                if released is None:
                    break  # FIFO: no overtaking, so a large prompt is not starved by small ones
                promised -= released
                cached, node = self._match(req)  # the victims' KV went to the cache
                need = total - len(cached)
                if not s.fits(need, reserve, promised, alone=not s.reqs):
                    s.cache.unlock(node)
                    break
            slot = self.kv.aux_pool.alloc()
            if slot is None:
                s.cache.unlock(node)
                break
            if not s.take_lora_slot(req):  # every LoRA slot holds an adapter running requests use
                self.kv.aux_pool.free(slot)
                s.cache.unlock(node)
                break
            new = s.try_alloc(need)
            s.hold(req, cached + new)  # the scheduler owns the pages from now on
            req.num_cache_pages, req.cache_node = len(cached), node
            e.receiver.held_pages = len(cached)
            e.receiver.init(new, slot)
            promised += reserve
            del self.entries[rid]
            out.append((req, e.receiver))
        return out
