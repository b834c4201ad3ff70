"""The loop of a prefill-mode scheduler rank.

A request's path (docs/ARCHITECTURE.md, request flow steps 3 and 5):

1. ``admit``: a KV sender is opened for its ``bootstrap_room``; the request
   waits in the ``BootstrapQueue`` until the decode side's destination arrives.
2. It joins the ordinary scheduler (FIFO admission, chunked prefill). After
   each chunk, ``poll`` queues the chunk's finished pages on the sender, so the
   transfer threads write them while the next chunk computes. Layer-wise
   (``--disaggregation-layerwise``): before each forward, ``layer_hook`` queues
   the pages that forward completes, tied to its ``LayerSignal``, so each
   layer's KV leaves while the next layers compute.
3. When the last chunk is computed and the first token sampled, the remaining
   pages go out with the aux data (first token, logprob, top logprobs), and the
   request waits in the ``InflightQueue`` holding its pages.
4. On Success its pages go to the prefix cache (or are freed) and it ends with
   its one token; on Failed it ends with an error naming the cause.

Under ``--speculative-algorithm NEXTN`` the model keeps its hidden rows, and the aux data of
step 3 also carries the last prompt position's hidden state, which the decode's MTP drafts from
(``engine/speculative/nextn_handoff.py``). After each forward the MTP layer runs over the step's
prompt rows into the pool's last layer (``engine/speculative/nextn_prompt.py``), so the pages of
step 2 carry its KV too (layer-wise: that layer last).

A ``/health_generate`` probe (``health_probe``) has no peer: it skips steps 1
and 3, so its prefill runs on this rank and its pages are dropped at once.

The HTTP answer is one final output, sent only at step 4, so that a router can
tell a room that succeeded from one that failed.
"""

from __future__ import annotations

import contextlib
import time

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.tier_metrics import hicache_families
from pdserve.engine.messages import RankMetrics, SchedulerStats
from pdserve.engine.sched.request import FinishReason, Req
from pdserve.engine.sched.scheduler import ScheduledBatch
from pdserve.engine.sched.scheduler_loop import SchedulerLoop
from pdserve.engine.speculative.nextn_handoff import aux_hidden_bytes, last_prompt_rows
from pdserve.engine.speculative.nextn_prompt import PromptMTP, then_mtp
from pdserve.kvtransfer.aux_pool import AuxData
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.layer_signal import LayerSignal
from pdserve.kvtransfer.prefill_kv_manager import PrefillKVManager
from pdserve.kvtransfer.room_queue import RoomQueue
from pdserve.kvtransfer.tp_agreement import agree
from pdserve.prefill.bootstrap_queue import BootstrapQueue


class PrefillLoop(SchedulerLoop):
    SIDE = "prefill"

    def __init__(self, config: EngineConfig, kv: PrefillKVManager, dp_rank: int = 0, runner=None):
        """``kv``: this rank's started KV manager over the runner's page pool; the loop closes it."""
        super().__init__(config, dp_rank, runner, decode=False)
        if kv.pool is not self.pool:
            raise ValueError("the KV manager must serve this rank's page pool")
        self.kv = kv
        self.bootstrap_queue = BootstrapQueue(kv, self.pool)
        self.senders: dict[str, KVSender] = {}  # requests inside the scheduler (waiting or prefilling)
        self.inflight: RoomQueue[Req, KVSender] = RoomQueue()  # last chunk queued, pages held
        # NEXTN: the hidden state of each prefilled request's last prompt position, until its aux data leaves
        self.hidden: dict[str, bytes] | None = None
        self.prompt_mtp: PromptMTP | None = None  # NEXTN: the MTP layer's KV of the prompts
        if aux_hidden_bytes(config.speculative_algorithm, self.runner):
            self.runner.model.keep_hidden = True
            self.hidden = {}
            self.prompt_mtp = PromptMTP(self.runner)

    # ------------------------------------------------------------------ inputs
    def validate(self, req: Req) -> str | None:
        error = super().validate(req)
        if error is None and req.bootstrap is None and not req.health_probe:
            error = "a prefill server needs bootstrap_host, bootstrap_port and bootstrap_room"
        if error is None and (req.rid in self.bootstrap_queue or req.rid in self.inflight):
            error = f"rid {req.rid!r} is already in flight"
        return error

    def admit(self, req: Req) -> FinishReason | None:
        if self.pool.pages_for(req.seq_len) > self.pool.capacity:
            return FinishReason("error", message=f"prompt of {req.seq_len} tokens exceeds the KV pool")
        req.stream = False  # one answer, after the KV left (or the room failed)
        if req.health_probe:  # no peer: prefill it, then drop its KV (step)
            return self.scheduler.add(req)
        error = self.bootstrap_queue.add(req)
        self._dirty = True
        if error:
            return FinishReason("error", message=error)
        self.request_log.attach(req.rid, self.bootstrap_queue.entries[req.rid][1])
        return None

    def abort(self, rid: str, reason: str = "aborted") -> bool:
        entry = self.bootstrap_queue.remove(rid)
        if entry is not None:
            req, sender = entry
            sender.abort(f"aborted by prefill: {reason}")
            self.finish_unscheduled(req, FinishReason("abort", message=reason))
            return True
        entry = self.inflight.remove(rid)
        if entry is not None:
            req, sender = entry
            sender.abort(f"aborted by prefill: {reason}")
            self.scheduler.finish(req, FinishReason("abort", message=reason))
            return True
        sender = self.senders.pop(rid, None)
        if sender is not None:
            sender.abort(f"aborted by prefill: {reason}")
        return super().abort(rid, reason)

    def live_requests(self) -> list[Req]:
        """The rank's requests, those still waiting for their decode's destination included."""
        return super().live_requests() + [req for req, _ in self.bootstrap_queue.entries.values()]

    # ------------------------------------------------------------------- loop
    def has_work(self) -> bool:
        return super().has_work() or bool(self.bootstrap_queue) or bool(self.inflight)

    def poll(self) -> None:
        self.bootstrap_queue.abort_mismatched()
        # the TP ranks agree on every open room before any is read (kvtransfer/tp_agreement.py)
        agree(self.bootstrap_queue.senders() + list(self.senders.values()) + [s for _, s in self.inflight.entries.values()])
        ready, failed = self.bootstrap_queue.pop_ready()
        for req, reason in failed:
            self.finish_unscheduled(req, FinishReason("error", message=reason))
        for req, sender in ready:
            self.request_log.mark(req.rid, "bootstrapped")
            if req.timeline is not None:
                req.timeline.bootstrapped = time.monotonic()
            reason = self.scheduler.add(req)
            if reason is not None:
                sender.abort(reason.message or reason.type)
                self._outbox.append(self._output(req))
            else:
                self.senders[req.rid] = sender
        # a room that failed while its request waits or prefills (decode aborted it): stop computing
        for rid, sender in list(self.senders.items()):
            if sender.poll() is KVPoll.Failed:
                del self.senders[rid]
                req = self.scheduler.reqs.get(rid)
                if req is not None:
                    self.scheduler.finish(req, FinishReason("error", message=f"KV transfer failed: {sender.failure_reason}"))
        # the chunk computed in the last step: its pages go out while the next chunk computes
        # (layer-wise, ``layer_hook`` queued them with that step's forward already)
        chunked = self.scheduler.chunked
        if chunked is not None and chunked.rid in self.senders and not self.kv.config.layerwise:
            self._send_pages(chunked, self.senders[chunked.rid], is_last=False)
        for req, sender in self.inflight.pop_done():
            if req.timeline is not None:
                self._note_transfer(req, sender)
            if sender.poll() is KVPoll.Success:
                self.request_log.mark(req.rid, "success")
                self.scheduler.finish(req, FinishReason("length"))
            else:
                self.scheduler.finish(req, FinishReason("error", message=f"KV transfer failed: {sender.failure_reason}"))

    def _note_transfer(self, req: Req, sender: KVSender) -> None:
        """A traced request's room ended: its transfer from the first chunk handed over to the last
        write done, and the KV bytes this rank wrote."""
        tl = req.timeline
        tl.transfer_start = sender.sent_at[0] if sender.sent_at else None
        tl.transfer_end = sender.written_at[-1] if sender.written_at else time.monotonic()
        tl.transfer_bytes = sender.bytes_sent
        tl.transfer_backend = self.kv.config.backend

    def layer_hook(self, batch: ScheduledBatch) -> contextlib.AbstractContextManager:
        """Layer-wise send: the pages this forward completes go to their senders now, tied to the
        forward's ``LayerSignal``; the transfer threads write each layer once it is stored. Under
        NEXTN the MTP layer runs over the step's prompt rows once the forward returned, its pool
        layer marked done last."""
        hook = self._send_hook(batch)
        mtp = self.prompt_mtp
        if mtp is None:
            return hook
        return then_mtp(hook, lambda: mtp.run(batch.reqs, batch.prefix_lens, batch.extend_lens), mtp.layer)

    def _send_hook(self, batch: ScheduledBatch) -> contextlib.AbstractContextManager:
        if not self.kv.config.layerwise:
            return contextlib.nullcontext()
        signal = self.kv.layer_signal()
        for req, prefix, extend, last in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample):
            sender = self.senders.get(req.rid)
            if sender is None:
                continue
            # as chunk-level: whole pages only until the last chunk, whose remaining pages all go
            end = self.pool.pages_for(req.prompt_len) if last else (prefix + extend) // self.pool.page_size
            self._queue_pages(sender, req.pages, end, signal)
        return signal if signal.watched else contextlib.nullcontext()

    def run_batch(self, batch: ScheduledBatch):
        sampled = super().run_batch(batch)
        if self.hidden is not None:
            self.hidden.update(last_prompt_rows(batch.reqs, batch.extend_lens, batch.sample,
                                                self.runner.model.last_hidden))
        return sampled

    def step(self):
        outputs, events = self.step_events()
        for req in events.prefilled:
            if req.health_probe:
                self.scheduler.finish(req, FinishReason("length"))
            else:
                self._send_last(req)
        if self.hidden is not None:
            self.hidden.clear()  # this step's rows were sent or are not wanted (a probe, a request that ended)
        # a request that ended without its last chunk sent (max_new_tokens 0, abort): close its room
        for req in events.finished:
            sender = self.senders.pop(req.rid, None)
            if sender is not None and not sender.poll().done:
                reason = req.finish_reason
                sender.abort(f"prefill ended the request: {reason.message or reason.type}")
        self.idle_tail(outputs)
        return outputs

    def _send_last(self, req: Req) -> None:
        """A request whose prefill completed: its last pages go out with the aux data."""
        sender = self.senders.pop(req.rid)
        top_n = self.kv.config.aux_max_top_logprobs
        hidden = self.hidden.pop(req.rid, b"") if self.hidden is not None else b""
        aux = AuxData(token_id=req.output_ids[0], cached_tokens=req.cached_tokens, hidden=hidden)
        if req.return_logprob and req.output_logprobs:
            top = req.output_top_logprobs[0][:top_n] if req.output_top_logprobs else []
            aux = AuxData(req.output_ids[0], req.output_logprobs[0], [t for t, _ in top], [lp for _, lp in top],
                          req.cached_tokens, hidden)
        self._send_pages(req, sender, is_last=True, aux=aux)
        self.inflight.add(req, sender)

    def _send_pages(self, req: Req, sender: KVSender, is_last: bool, aux: AuxData | None = None) -> None:
        """Queue the pages whose KV is complete and not yet sent (all remaining ones if last)."""
        end = self.pool.pages_for(req.prompt_len) if is_last else req.kv_len // self.pool.page_size
        self._queue_pages(sender, req.pages, end, is_last=is_last, aux=aux)

    @staticmethod
    def _queue_pages(sender: KVSender, pages: list[int], end: int, layers: LayerSignal | None = None,
                     is_last: bool = False, aux: AuxData | None = None) -> None:
        """Queue ``pages[held + sender.pages_sent:end]`` (the last chunk even when empty: it carries the aux
        data); the decode's ``held`` leading pages are not sent."""
        if sender.poll() is KVPoll.Failed:
            return
        start = sender.num_held_pages + sender.pages_sent
        if end > start or is_last:
            sender.send(pages[start:end], is_last, aux, layers)

    def stats(self) -> SchedulerStats:
        # the KV manager's refusals ride along with the rank's stats to the front end's /metrics
        return msgspec.structs.replace(super().stats(), kv_auth_refused=self.kv.auth_refused,
                                       num_prefill_prealloc_queue_reqs=len(self.bootstrap_queue),
                                       num_prefill_inflight_queue_reqs=len(self.inflight))

    def rank_metrics(self) -> RankMetrics:
        return RankMetrics(self.dp_rank, self.kv.tp.rank, self.kv.metrics.snapshot() + hicache_families(self.cache)
                          + self.sched_families() + self.runner.model_families())

    def check_integrity(self) -> None:
        super().check_integrity()
        for rid in self.inflight.entries:
            if rid not in self.scheduler.reqs:
                raise AssertionError(f"inflight {rid} is not owned by the scheduler")

    def close(self) -> None:
        self.kv.close()
        super().close()  # the storage tier's queued puts
