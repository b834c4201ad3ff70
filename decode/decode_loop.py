"""The loop of a decode-mode scheduler rank.

A request's path (docs/ARCHITECTURE.md, request flow steps 4 and 6):

1. ``admit``: it waits in the ``PreallocQueue``, which opens a KV receiver
   (the prefill rank is looked up through the bootstrap server) and, once the
   prefill rank accepted this pool, preallocates pages for the prompt and an
   aux slot and sends them to prefill (``receiver.init``).
2. ``TransferQueue``: the request holds its pages until the room succeeds or
   fails.
A request without bootstrap fields (``max_local_prefill_tokens`` > 0, a prompt
at most that long: the router's conditional disaggregation) skips 1-2: the
scheduler prefills it here like a colocated request, in the running batch:
as a mixed chunk (``local_prefill_config``), so each step carries the running
decodes plus at most ``max_local_prefill_tokens`` prompt tokens, and a long
local prefill never stalls the decodes for more than that many tokens a step.
A ``/health_generate`` probe (``health_probe``) takes the same local path
whatever ``max_local_prefill_tokens`` is.

3. On Success its first token (and logprobs) come from the aux slot; it joins
   the running decode batch with ``scheduler.add_prefilled`` and streams from
   there like any colocated request (retraction and recompute included). A
   constrained request's matcher accepts that first token first, so its grammar
   continues from where prefill's left off.
   Drafting with NEXTN, the aux data also carries the prompt's last hidden state, which the MTP
   proposer starts from (``engine/speculative/nextn_handoff.py``); a room without it (a prefill
   not started with NEXTN) ends the request with an error naming the flag.
   On Failed it ends with an error naming the cause. Its pages (and aux slot) are freed, or,
   when the prefill already had its destination, held in the ``Quarantine`` until the prefill
   closes the room (a write in flight there could still land) or ``quarantine_timeout`` passed.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pdserve.decode.prealloc_queue import PreallocQueue
from pdserve.decode.prefill_dp_sizes import PrefillDPSizes
from pdserve.decode.quarantine import Quarantine
import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.tier_metrics import hicache_families
from pdserve.engine.messages import RankMetrics, SchedulerStats
from pdserve.engine.pd_rules import local_prefill_refusal
from pdserve.engine.speculative.nextn_handoff import NO_HIDDEN_STATE, PromptKV, aux_hidden_bytes, hidden_row
from pdserve.engine.sched.request import FinishReason, Req
from pdserve.engine.sched.scheduler_loop import SchedulerLoop
from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.kvtransfer.room_queue import RoomQueue
from pdserve.kvtransfer.tp_agreement import FAILED_ELSEWHERE, agree, agree_values, agreed_clock, may_be_written

logger = logging.getLogger(__name__)


def local_prefill_config(config: EngineConfig, max_local_prefill_tokens: int) -> EngineConfig:
    """The decode rank's scheduling: with local prefill, ``max_local_prefill_tokens`` is also the
    per-step prefill budget and running decodes ride along (mixed chunks), which bounds what a
    local prefill adds to the TPOT of the requests decoding here. A retracted request's recompute
    is chunked within the same budget."""
    if not max_local_prefill_tokens:
        return config
    return dataclasses.replace(config, enable_mixed_chunk=True,
                               chunked_prefill_size=min(config.chunked_prefill_size, max_local_prefill_tokens))


class DecodeLoop(SchedulerLoop):
    SIDE = "decode"

    def __init__(self, config: EngineConfig, kv: DecodeKVManager, dp_rank: int = 0, runner=None,
                 max_local_prefill_tokens: int = 0):
        """``kv``: this rank's started KV manager over the runner's page pool; the loop closes it.
        Timeouts run on ``kv.clock``, so a test can move time for both. ``max_local_prefill_tokens``:
        the longest prompt prefilled here when it comes without bootstrap fields (0: none)."""
        super().__init__(local_prefill_config(config, max_local_prefill_tokens), dp_rank, runner)
        self.max_local_prefill_tokens = max_local_prefill_tokens
        if kv.pool is not self.pool:
            raise ValueError("the KV manager must serve this rank's page pool")
        # NEXTN: the bytes of the hidden state each room's aux data brings (0: none wanted)
        self.hidden_bytes = aux_hidden_bytes(config.speculative_algorithm, self.runner)
        if kv.aux_pool.hidden_bytes != self.hidden_bytes:
            raise ValueError(f"the KV manager's aux slots hold {kv.aux_pool.hidden_bytes} bytes of hidden state, "
                             f"this rank's drafts need {self.hidden_bytes} (DecodeKVManager aux_hidden_bytes)")
        self.kv = kv
        self.dp_sizes = PrefillDPSizes(kv.config.bootstrap_timeout, clock=kv.clock)
        self.prealloc = PreallocQueue(kv, self.scheduler)
        self.transfer: RoomQueue[Req, KVReceiver] = RoomQueue()  # destination sent, pages held
        self.quarantine = Quarantine(kv.config.quarantine_timeout, self.scheduler.held_pages)
        self._now = kv.clock()  # the TP ranks' agreed clock at the last poll (quarantine times)

    # ------------------------------------------------------------------ inputs
    def validate(self, req: Req) -> str | None:
        error = super().validate(req)
        too_long = len(req.input_ids) > self.max_local_prefill_tokens
        if error is None and req.bootstrap is None and too_long and not req.health_probe:
            error = local_prefill_refusal(len(req.input_ids), self.max_local_prefill_tokens)
        if error is None and req.rid in self.prealloc:
            error = f"rid {req.rid!r} is already in flight"
        return error

    def admit(self, req: Req) -> FinishReason | None:
        if self.pool.pages_for(req.seq_len + 1) > self.pool.capacity:
            return FinishReason("error", message=f"prompt of {req.seq_len} tokens exceeds the KV pool")
        if req.bootstrap is None:  # a local prefill: the colocated path
            return super().admit(req)
        self.prealloc.add(req)
        self._dirty = True
        return None

    def abort(self, rid: str, reason: str = "aborted") -> bool:
        entry = self.prealloc.remove(rid)
        if entry is not None:
            if entry.receiver is not None:
                entry.receiver.abort(f"aborted by decode: {reason}")
            self.finish_unscheduled(entry.req, FinishReason("abort", message=reason))
            return True
        moving = self.transfer.remove(rid)
        if moving is not None:
            req, receiver = moving
            receiver.abort(f"aborted by decode: {reason}")
            self._end_transfer(req, receiver, FinishReason("abort", message=reason))
            return True
        return super().abort(rid, reason)

    def live_requests(self) -> list[Req]:
        """The rank's requests, those still waiting for pages and a room included."""
        return super().live_requests() + [e.req for e in self.prealloc.entries.values()]

    # ------------------------------------------------------------------- loop
    def has_work(self) -> bool:
        return super().has_work() or bool(self.prealloc) or bool(self.transfer) or bool(self.quarantine)

    def poll(self) -> None:
        # the TP ranks agree on every open room, quarantined room and DP-size lookup before any is read
        # (kvtransfer/tp_agreement.py)
        unresolved = self.prealloc.unresolved()
        agree(self.prealloc.receivers() + [r for _, r in self.transfer.entries.values()],
              closing=[held.receiver for held in self.quarantine.entries])
        self._now = agreed_clock(self.kv.clock())
        self._release_quarantined()
        for req, reason in self.prealloc.pop_failed(self._dp_sizes(unresolved)):
            self.finish_unscheduled(req, FinishReason("error", message=reason))
        s = self.scheduler
        promised = s.promised_pages(self.transfer.reqs())
        max_new = self.config.max_running_requests - len(s.running) - len(self.transfer) - (s.chunked is not None)
        for req, receiver in self.prealloc.pop_allocated(promised, max(max_new, 0)):
            self.request_log.mark(req.rid, "preallocated")
            if req.timeline is not None:
                req.timeline.prealloc_done = receiver.init_at  # pages held, the destination handed over
            self.transfer.add(req, receiver)
        for req, receiver in self.transfer.pop_done():
            if req.timeline is not None:
                self._note_transfer(req, receiver)
            if receiver.poll() is KVPoll.Success:
                self.request_log.mark(req.rid, "kv_landed")
                self._start_decoding(req, receiver)
            else:
                self._end_transfer(req, receiver, FinishReason("error", message=f"KV transfer failed: {receiver.failure_reason}"))

    def _note_transfer(self, req: Req, receiver: KVReceiver) -> None:
        """A traced request's room ended: its transfer from the destination sent to now, and the KV
        bytes of the pages it received (those its prefix cache held were not sent)."""
        tl = req.timeline
        tl.transfer_start = receiver.init_at
        tl.transfer_end = time.monotonic()
        tl.transfer_bytes = len(receiver.dst_pages or ()) * self.kv.metrics.room_page_bytes
        tl.transfer_backend = self.kv.config.backend

    def _dp_sizes(self, entries) -> dict[str, int | str]:
        """The prefill DP sizes of ``entries`` that every TP rank knows: a size, or why it failed."""
        sizes = [self.dp_sizes.get(e.req.bootstrap.host, e.req.bootstrap.port) for e in entries]
        # a size > 0; 0 while unknown on some rank; -1 once failed on some rank
        codes = agree_values([s if isinstance(s, int) else 0 if s is None else -1 for s in sizes])
        out: dict[str, int | str] = {}
        for e, size, code in zip(entries, sizes, codes):
            if code > 0:
                out[e.req.rid] = code
            elif code < 0:
                out[e.req.rid] = size if isinstance(size, str) else f"prefill DP size lookup: {FAILED_ELSEWHERE}"
        return out

    def _end_transfer(self, req: Req, receiver: KVReceiver, reason: FinishReason) -> None:
        """Finish a request whose room did not succeed; quarantine its pages if the prefill may write them."""
        if receiver.poll() is KVPoll.Failed and may_be_written(receiver):
            held = req.pages[req.num_cache_pages :]
            req.pages = req.pages[: req.num_cache_pages]
            logger.info("decode: room %d failed after the prefill got its destination: %d pages held until "
                        "it closes the room", receiver.room, len(held))
            self.quarantine.hold(receiver, held, receiver.aux_slot, self._now)
            receiver.aux_slot = None
        else:
            self._release_aux(receiver)
        self.scheduler.finish(req, reason)

    def _release_quarantined(self) -> None:
        if not self.quarantine:
            return
        for pages, aux_slot, timed_out in self.quarantine.pop_released(self._now):
            logger.info("decode: %d quarantined pages back in the free list", len(pages))
            if timed_out:
                logger.warning("decode: %d quarantined pages reused after quarantine_timeout %ss without the "
                               "prefill closing their room", len(pages), self.quarantine.timeout)
            self.pool.free(pages)
            if aux_slot is not None:
                self.kv.aux_pool.free(aux_slot)
            self._dirty = True

    def _start_decoding(self, req: Req, receiver: KVReceiver) -> None:
        aux = receiver.aux()
        self._release_aux(receiver)
        if aux is None:
            self.scheduler.finish(req, FinishReason("error", message="KV transfer failed: no first token in the aux data"))
            return
        if self.hidden_bytes and not aux.hidden:
            self.scheduler.finish(req, FinishReason("error", message=f"KV transfer failed: {NO_HIDDEN_STATE}"))
            return
        req.kv_len = req.prompt_len
        req.admitted_once = True
        req.cached_tokens = aux.cached_tokens  # the prefill's cache hits: what this request did not compute
        req.output_ids.append(aux.token_id)
        if req.grammar is not None:  # prefill sampled it under the same grammar: continue from it
            req.grammar.accept(aux.token_id)
        if req.return_logprob:
            req.output_logprobs.append(aux.logprob)
            req.output_top_logprobs.append(list(zip(aux.top_ids, aux.top_logprobs))[: req.top_logprobs_num])
        self.request_log.mark(req.rid, "first_token")
        reason = self.stop_checker(req)
        if reason is not None:
            self.scheduler.finish(req, reason)  # its output comes from the step's finished list
            return
        if self.hidden_bytes:  # the MTP drafts from the prompt's last position on
            arch = self.runner.arch
            self.spec.observe_handed(req, req.prompt_len - 1,
                                     hidden_row(aux.hidden, arch.hidden_size, self.runner.dtype, self.device),
                                     self._prompt_mtp_kv(req))
        self.scheduler.add_prefilled(req)
        if req.stream:
            self._outbox.append(self._output(req))

    def _prompt_mtp_kv(self, req: Req) -> PromptKV | None:
        """Where the prefill's MTP KV of ``req``'s prompt arrived: the pool's layer past the model's
        (``nextn_handoff.mtp_kv_layers``). None when the pool has no such layer, or when pages of this
        rank's prefix cache stood in for some (their MTP rows were never sent): the MTP then starts
        at the prompt's last position."""
        if self.pool.num_layers <= self.runner.arch.num_layers or req.num_cache_pages:
            return None
        return PromptKV(self.pool, self.runner.arch.num_layers, list(req.pages), req.prompt_len - 1)

    def step(self):
        outputs = super().step()
        self.idle_tail(outputs)
        return outputs

    def _release_aux(self, receiver: KVReceiver) -> None:
        if receiver.aux_slot is not None:
            self.kv.aux_pool.free(receiver.aux_slot)
            receiver.aux_slot = None

    def stats(self) -> SchedulerStats:
        # the KV manager's refusals ride along with the rank's stats to the front end's /metrics
        return msgspec.structs.replace(super().stats(), kv_auth_refused=self.kv.auth_refused,
                                       num_decode_prealloc_queue_reqs=len(self.prealloc),
                                       num_decode_transfer_queue_reqs=len(self.transfer),
                                       num_quarantine_pages=self.quarantine.num_pages)

    def rank_metrics(self) -> RankMetrics:
        return RankMetrics(self.dp_rank, self.kv.tp.rank,
                           self.kv.metrics.snapshot() + hicache_families(self.cache) + self.spec_families()
                           + self.sched_families() + self.runner.model_families())

    def check_integrity(self) -> None:
        super().check_integrity()
        for rid in self.transfer.entries:
            if rid not in self.scheduler.reqs:
                raise AssertionError(f"transferring {rid} is not owned by the scheduler")
        if not self.transfer and self.kv.aux_pool.num_free + self.quarantine.aux_slots != self.kv.aux_pool.num_slots:
            raise AssertionError("aux slots leaked")

    def close(self) -> None:
        self.dp_sizes.close()
        self.kv.close()
        super().close()  # the storage tier's queued puts (the decode's write-back) and the proposer
