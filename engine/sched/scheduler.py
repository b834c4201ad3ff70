"""Continuous-batching scheduler: pure bookkeeping, no sockets, threads or device calls.

``schedule()`` picks the next step's work and returns a ``ScheduledBatch``;
the caller runs the model on it and hands the sampled tokens to
``postprocess()``. Rules (SGLang's, simplified):

- Prefill first: if waiting work fits, the step is a prefill batch; otherwise
  the running requests decode one token each.
- Admission is in queue order, with no overtaking (so nothing starves); the
  queue is in arrival order (``schedule_policy`` fcfs) or, with ``lpm``, sorted
  by prefix-cache match before each admission round (schedule_policy.py). It needs free pages
  (free + evictable cache pages) for the whole prompt plus a reserve of
  ``num_reserved_decode_tokens`` per running request for its coming decodes;
  at most ``max_running_requests`` are admitted.
- A prompt longer than the step budget (``min(chunked_prefill_size,
  max_prefill_tokens)``) is prefilled in chunks, one chunked request at a
  time. Its pages are allocated for the whole prompt on admission, so a
  chunk never waits for memory.
- With ``enable_mixed_chunk``, a prefill step also carries every running
  request's next token (taken out of the step's token budget), so decodes keep
  going while a long prompt is prefilled in chunks; where that would use the
  whole budget, or their next pages are short, the step stays prefill-only.
- The admission rule (``fits``) and the decode reserve (``reserve_pages``) are
  public: the decode mode's preallocation applies the same rule to requests
  whose KV arrives from a prefill server.
- A prefill server's scheduler (``decode=False``) does not decode: a request
  whose prefill completed (its one token sampled, never stopped on) keeps its
  pages, leaves the batch and is reported in ``StepEvents.prefilled``; it stays
  owned until ``finish``.
- Speculative decoding (docs/SPECULATIVE.md): a decode batch may carry draft tokens per request
  (``attach_drafts``): each such request feeds its last token plus its drafts in one step, whose
  pages are taken from the free pages only if they all fit (else the batch runs without drafts,
  never failing); ``postprocess`` appends the accepted run plus the bonus token, stopping at the
  first token that ends the request, and frees the pages past what the accepted tokens need.
  The decode reserve of ``reserve_pages`` counts ``speculative_num_draft_tokens`` more per request.
- When a decode step lacks pages, the newest running request is retracted: its
  KV goes to the prefix cache (or is freed) and it rejoins the front of the
  queue keeping its output tokens, to be recomputed later. A request that
  cannot grow even alone in the pool finishes with ``length``.
- With ``enable_priority_scheduling``, retraction takes the lowest priority first, and a waiting
  request that lacks pages or a running slot preempts (retracts) running requests of lower
  priority when they free enough (``preemption.py``; ``preempt_for``, also used by the decode
  mode's preallocation).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import PrefixCache
from pdserve.engine.model_executor.layers.lora_slots import LoraSlots, LoraSlotsFull
from pdserve.engine.sched.request import FinishReason, Req, ReqStatus
from pdserve.engine.sched.preemption import pick_victims, preemption_order
from pdserve.engine.sched.priority_order import order_by_priority
from pdserve.engine.sched.schedule_policy import order_waiting
from pdserve.engine.speculative.proposer import is_chain

StopCheck = Callable[[Req], "FinishReason | None"]


def length_only_stop(req: Req) -> FinishReason | None:
    """Default stop rule: only ``max_new_tokens`` (the loop passes a full StopChecker)."""
    if len(req.output_ids) >= req.sampling_params.max_new_tokens:
        return FinishReason("length")
    return None


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # some sequences add several tokens (may include chunks)
    DECODE = "decode"  # every sequence adds one token


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]  # KV tokens already in the cache per request
    extend_lens: list[int]  # new tokens this step per request
    sample: list[bool]  # whether the request samples a token after this step
    # decode steps with speculation: per request its draft tokens (fed after its last token), or None
    drafts: list[list[int]] | None = None
    # verify steps where some draft is a tree (several branches): per request its draft nodes'
    # parents (-1: the fed token; docs/SPECULATIVE.md, "Trees"); None: every draft is a chain
    draft_parents: list[list[int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def sampled_reqs(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sample) if s]

    def logit_rows(self, i: int) -> int:
        """Rows of logits request ``i`` gets if it samples: one per fed token of a verify step, else one."""
        return 1 + len(self.drafts[i]) if self.drafts is not None else 1


@dataclass
class SampleOutput:
    """What the model step produced for the sampled requests, in batch order."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # verify steps: per sampled request every token it gained (its accepted drafts, then the bonus
    # token); ``token_ids`` holds the first of each
    accepted: list[list[int]] | None = None
    # verify steps of draft trees: per sampled request the accepted draft nodes (indices into its
    # draft), root to leaf; None: every draft was a chain (the accepted nodes are 0, 1, ...)
    accepted_nodes: list[list[int]] | None = None


@dataclass
class StepEvents:
    """What changed since the last report, for the loop to act on and report."""

    updated: list[Req] = field(default_factory=list)  # got at least one new token
    # every request finished since the last report, by any path (stop, abort, no room): the one way out
    finished: list[Req] = field(default_factory=list)
    prefilled: list[Req] = field(default_factory=list)  # completed their prefill this step


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        pool: PagePool,
        cache: PrefixCache,
        stop_check: StopCheck = length_only_stop,
        decode: bool = True,
        lora_slots: LoraSlots | None = None,
    ):
        """``decode=False``: a prefill server's scheduler (see the module docstring). ``lora_slots``:
        which adapters sit in the model's LoRA slots (``--enable-lora``); a request with an adapter
        pins its slot from admission to release, and waits while every slot is pinned."""
        self.config = config
        self.decode = decode
        self.pool = pool
        self.cache = cache
        self.stop_check = stop_check
        self.page_size = pool.page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # decoding, oldest admitted first
        self.chunked: Req | None = None  # admitted, prefill not complete
        self.reqs: dict[str, Req] = {}  # every live request by rid
        # used pages owned by no request nor the cache, on purpose (the decode's quarantine of failed rooms)
        self.held_pages: set[int] = set()
        self.num_retractions = 0  # every retraction, for memory or for priority
        self.num_preemptions = 0  # retractions for a waiting request of higher priority
        self._arrivals = itertools.count()
        # every finish (stop, abort, no room) lands here; ``drain_finished`` reports each once
        self.newly_finished: list[Req] = []
        # slots a speculating request may need past its next token, counted in its decode reserve
        self.num_draft_slots = config.speculative_num_draft_tokens if config.speculative_algorithm else 0
        self.lora_slots = lora_slots
        self.lora_loads: list[tuple[int, str]] = []  # (slot, adapter) placed since the loop last loaded
        self.num_lora_slot_loads = 0  # adapters placed in a slot since start (pdserve_lora_adapter_loads_total)

    # ------------------------------------------------------------- requests
    def add(self, req: Req) -> FinishReason | None:
        """Queue a request; returns a finish reason if it can never run."""
        if req.rid in self.reqs:
            raise ValueError(f"duplicate rid {req.rid!r}")
        if self.pool.pages_for(req.seq_len) > self.pool.capacity:
            req.finish_reason = FinishReason(
                "error", message=f"prompt of {req.seq_len} tokens exceeds the KV pool"
            )
            req.status = ReqStatus.FINISHED
            return req.finish_reason
        req.status = ReqStatus.WAITING
        req.arrival = next(self._arrivals)
        self.reqs[req.rid] = req
        self.waiting.append(req)
        return None

    def abort(self, rid: str, reason: str = "aborted") -> Req | None:
        """End a live request now and free its pages; None if unknown or already done."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        self.finish(req, FinishReason("abort", message=reason))
        return req

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Mark ``req`` finished and release everything it holds."""
        req.finish_reason = reason
        if req.status == ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.release(req)
        self.cache.cancel_prefetch(req.rid)
        req.status = ReqStatus.FINISHED
        self.reqs.pop(req.rid, None)
        self.newly_finished.append(req)

    def drain_finished(self) -> list[Req]:
        """Requests finished since the last call (by any path)."""
        out, self.newly_finished = self.newly_finished, []
        return out

    def release(self, req: Req) -> None:
        """Give the request's KV to the prefix cache (or free it) and drop its lock."""
        if req.pages:
            self.cache.insert(req.cache_key(req.kv_len), req.pages, req.num_cache_pages)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.pages = []
        req.kv_len = 0
        req.num_cache_pages = 0
        req.cache_node = None
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_name)
            req.lora_slot = -1

    # ----------------------------------------------------------------- LoRA
    def take_lora_slot(self, req: Req) -> bool:
        """Pin a slot for the request's adapter while it runs (an adapter placed anew is queued in
        ``lora_loads`` for the loop to load before the step); False when every slot is pinned."""
        if req.lora_name is None:
            return True
        placed = self.lora_slots.slot_of(req.lora_name) is not None
        try:
            slot, _ = self.lora_slots.acquire(req.lora_name)
        except LoraSlotsFull:
            return False
        if not placed:
            self.lora_loads.append((slot, req.lora_name))
            self.num_lora_slot_loads += 1
        req.lora_slot = slot
        return True

    def drain_lora_loads(self) -> list[tuple[int, str]]:
        """The (slot, adapter) placements since the last call: load them before the next forward."""
        out, self.lora_loads = self.lora_loads, []
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # --------------------------------------------------------------- memory
    def free_pages(self) -> int:
        """Pages that can be handed out now: free, or held by the prefix cache and evictable."""
        return self.pool.num_free + self.cache.evictable_pages

    def _alloc(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > 0:
            # evict in batches of >= 1/64 of the pool: an eviction walks the whole tree, so
            # evicting one page per decode step on a full pool would walk it every step
            self.cache.evict(max(short, self.pool.capacity // 64))
        return self.pool.alloc(n)

    def reserve_pages(self, req: Req, after_len: int) -> int:
        """Pages ``req`` still needs beyond those it holds to reach ``after_len`` tokens and then
        decode ``num_reserved_decode_tokens`` more (at most its remaining new tokens)."""
        extra = min(req.remaining_new_tokens, self.config.num_reserved_decode_tokens + self.num_draft_slots)
        return max(self.pool.pages_for(after_len + extra) - len(req.pages), 0)

    def promised_pages(self, receiving: Iterable[Req] = ()) -> int:
        """The reserve promised to running decodes, and to ``receiving`` requests (decode mode:
        pages held for a prompt's KV in flight, decoding from one token past the prompt)."""
        return sum(self.reserve_pages(r, r.seq_len) for r in self.running) + sum(
            self.reserve_pages(r, r.seq_len + 1) for r in receiving
        )

    def fits(self, take: int, reserve: int, promised: int, alone: bool) -> bool:
        """The admission rule, for colocated admission and decode preallocation alike: a request
        taking ``take`` pages now and promised ``reserve`` more for its decodes fits beside the
        ``promised`` reserve of requests already holding pages, or, ``alone`` (nothing else
        holds pages), when what it takes now is free: a large prompt must not wait forever."""
        free = self.free_pages()
        return take + reserve + promised <= free or (alone and take <= free)

    def try_alloc(self, n: int) -> list[int] | None:
        """``n`` pages (evicting cache pages if needed), or None if short."""
        if n > self.free_pages():
            return None
        return self._alloc(n)

    def hold(self, req: Req, pages: list[int]) -> None:
        """Decode mode: own ``req`` and the ``pages`` preallocated for its incoming KV (from
        ``try_alloc``) until it joins the decode batch (``add_prefilled``) or ends (``finish``)."""
        if req.rid in self.reqs:
            raise ValueError(f"duplicate rid {req.rid!r}")
        req.pages = pages
        req.kv_len = 0
        req.arrival = next(self._arrivals)
        self.reqs[req.rid] = req

    # ------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        budget = min(self.config.chunked_prefill_size, self.config.max_prefill_tokens)
        mixed = self.config.enable_mixed_chunk and 0 < len(self.running) < budget
        if mixed:
            budget -= len(self.running)  # one token each for the running requests
        batch = ScheduledBatch(ForwardMode.PREFILL, [], [], [], [])

        def add_to_batch(req: Req) -> None:
            nonlocal budget
            extend = min(req.seq_len - req.kv_len, budget)
            budget -= extend
            done = req.kv_len + extend == req.seq_len
            batch.reqs.append(req)
            batch.prefix_lens.append(req.kv_len)
            batch.extend_lens.append(extend)
            batch.sample.append(done)
            self.chunked = None if done else req

        if self.chunked is not None:
            add_to_batch(self.chunked)
        else:
            order_waiting(self.config.schedule_policy, self.waiting, self.cache)
            if self.config.enable_priority_scheduling:
                order_by_priority(self.waiting, self.config.schedule_low_priority_values_first)

        promised = self.promised_pages()
        while self.waiting and budget > 0 and self.chunked is None:
            req = self.waiting[0]
            if len(self.running) + len(batch.reqs) >= self.config.max_running_requests:
                released = self.preempt_for(req, 0, need_slot=True)
                if released is None:
                    break
                promised -= released
            if not self.cache.prefetch_ready(req.rid):
                break
            # leave at least one token to compute: its logits give the next token
            match_len = req.seq_len - 1
            if req.wants_input_logprobs:  # positions whose logits are wanted must be computed
                match_len = min(match_len, max(req.logprob_start_len + len(req.input_logprobs) - 1, 0))
            loads = self._tier_loads() if not req.admitted_once else None
            cached_pages, node = self.cache.match_prefix(req.cache_key(match_len))
            if loads is not None:
                self._note_tier_loads(req, loads)
            self.cache.lock(node)
            need = self.pool.pages_for(req.seq_len) - len(cached_pages)
            # req holds no pages yet: its reserve is what it needs past its prompt's pages
            reserve = self.reserve_pages(req, req.seq_len) - self.pool.pages_for(req.seq_len)
            alone = not self.running and not batch.reqs
            if not self.fits(need, reserve, promised, alone):
                self.cache.unlock(node)
                if alone and self.pool.pages_for(req.seq_len) > self.pool.capacity:
                    # a retracted request that outgrew the whole pool can never run again
                    self.finish(req, FinishReason("length", message="KV pool too small for this sequence"))
                    continue
                released = self.preempt_for(req, need + reserve + promised - self.free_pages())
                if released is None:
                    break
                promised -= released
                continue  # match again: the victims' KV went to the cache
            if not self.take_lora_slot(req):  # every slot holds an adapter running requests use
                self.cache.unlock(node)
                break
            self.waiting.popleft()
            req.pages = cached_pages + self._alloc(need)
            req.num_cache_pages = len(cached_pages)
            req.cache_node = node
            req.kv_len = len(cached_pages) * self.page_size
            if not req.admitted_once:
                req.cached_tokens = req.kv_len
                req.host_hit_tokens = min(req.host_hit_tokens, req.cached_tokens)
                req.storage_hit_tokens = min(req.storage_hit_tokens, req.cached_tokens - req.host_hit_tokens)
                req.admitted_once = True
            req.status = ReqStatus.RUNNING
            promised += reserve
            add_to_batch(req)
        if not batch.reqs:
            return None
        if mixed:
            self._add_decodes(batch)
        return batch

    def _tier_loads(self) -> tuple[int, int]:
        """Pages the hierarchical cache has loaded into the pool so far, from its host tier and from
        what its storage tier fetched (its ``TierStats``, as /metrics reads them); (0, 0) without one."""
        stats = getattr(self.cache, "stats", None)
        return (stats.host_hit_pages, stats.store_hit_pages) if stats is not None else (0, 0)

    def _note_tier_loads(self, req: Req, before: tuple[int, int]) -> None:
        """Credit ``req`` with the lower-tier pages its match just loaded (every match before its
        first admission counts: an earlier one's loads are in the pool when a later one admits it)."""
        host, storage = self._tier_loads()
        req.host_hit_tokens += (host - before[0]) * self.page_size
        req.storage_hit_tokens += (storage - before[1]) * self.page_size

    def _add_decodes(self, batch: ScheduledBatch) -> None:
        """Mixed step: every running request adds its next token, if their pages can be had."""
        growing = [r for r in self.running if self.pool.pages_for(r.kv_len + 1) > len(r.pages)]
        if len(growing) > self.free_pages():
            return  # the next decode-only step retracts as needed
        for r in growing:
            r.pages.extend(self._alloc(1))
        for r in self.running:
            batch.reqs.append(r)
            batch.prefix_lens.append(r.kv_len)
            batch.extend_lens.append(1)
            batch.sample.append(True)

    def _schedule_decode(self) -> ScheduledBatch | None:
        while self.running:
            need = sum(1 for r in self.running if self.pool.pages_for(r.kv_len + 1) > len(r.pages))
            if need <= self.free_pages():
                break
            if len(self.running) == 1:
                self.finish(self.running[0], FinishReason("length", message="KV pool too small for this sequence"))
                break
            if self.config.enable_priority_scheduling:
                self.retract(preemption_order(self.running, self.config.schedule_low_priority_values_first)[0])
            else:
                self.retract(self.running[-1])
        if not self.running:
            return None
        for r in self.running:
            if self.pool.pages_for(r.kv_len + 1) > len(r.pages):
                r.pages.extend(self._alloc(1))
        n = len(self.running)
        return ScheduledBatch(
            ForwardMode.DECODE, list(self.running), [r.kv_len for r in self.running], [1] * n, [True] * n
        )

    def reserve_draft_pages(self, batch: ScheduledBatch, budgets: list[int]) -> list[int] | None:
        """Before a draft that writes into the target's KV proposes: give each request of decode
        ``batch`` the pages for ``kv_len + 1 + budgets[i]`` tokens. Returns the pages each held
        before (``attach_drafts`` gives back what its drafts do not use), or None, taking nothing,
        where they are not all free (the batch then runs without drafts)."""
        held = [len(r.pages) for r in batch.reqs]
        need = [max(self.pool.pages_for(r.kv_len + 1 + b) - n, 0) for r, b, n in zip(batch.reqs, budgets, held)]
        if sum(need) > self.free_pages():
            return None
        for r, n in zip(batch.reqs, need):
            if n:
                r.pages.extend(self._alloc(n))
        return held

    def attach_drafts(self, batch: ScheduledBatch, drafts: list[list[int]],
                      parents: list[list[int]] | None = None, held: list[int] | None = None) -> bool:
        """Let decode ``batch`` verify ``drafts`` (one list per request, maybe empty): each is cut to
        what the request may still output past its bonus token, and the pages the draft slots need
        are taken now. If they are not all free, nothing changes and False says the batch runs
        without drafts (a batch is never failed for its drafts). ``parents``: per request its draft
        nodes' parents where a draft may be a tree (nodes are cut alike, parents before children).
        ``held``: ``reserve_draft_pages``'s answer; pages reserved past what the drafts (or, without
        them, the step) need go back."""
        if batch.mode != ForwardMode.DECODE or len(drafts) != len(batch.reqs):
            raise ValueError("drafts ride on a decode batch, one list per request")
        drafts = [d[: max(r.remaining_new_tokens - 1, 0)] for r, d in zip(batch.reqs, drafts)]
        need = [max(self.pool.pages_for(r.kv_len + 1 + len(d)) - len(r.pages), 0) for r, d in zip(batch.reqs, drafts)]
        ok = any(drafts) and sum(need) <= self.free_pages()
        if held is not None:
            for r, d, n in zip(batch.reqs, drafts, held):
                keep = max(n, self.pool.pages_for(r.kv_len + 1 + (len(d) if ok else 0)))
                if len(r.pages) > keep:
                    self.pool.free(r.pages[keep:])
                    del r.pages[keep:]
        if not ok:
            return False
        for r, n in zip(batch.reqs, need):
            if n:
                r.pages.extend(self._alloc(n))
        batch.drafts = drafts
        batch.extend_lens = [1 + len(d) for d in drafts]
        if parents is not None:
            parents = [list(p[: len(d)]) for p, d in zip(parents, drafts)]
            if not all(map(is_chain, parents)):
                batch.draft_parents = parents
        return True

    def retract(self, req: Req) -> None:
        """Preempt a running request: free its KV (into the cache) and queue it first for recompute."""
        self.running.remove(req)
        self.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def preempt_for(self, req: Req, short_pages: int, need_slot: bool = False) -> int | None:
        """With priority scheduling, retract the running requests of lower priority than ``req`` that
        give back ``short_pages`` pages (and a running slot when ``need_slot``), lowest priority and
        latest arrival first (``preemption.pick_victims``). Returns the decode reserve they were
        promised (to take off a running ``promised`` sum), or None when nothing was preempted: no
        such requests, or too few to make ``req`` fit."""
        if not self.config.enable_priority_scheduling:
            return None
        low_first = self.config.schedule_low_priority_values_first
        victims = pick_victims(req, self.running, short_pages, need_slot, self._preempt_gain, low_first)
        if not victims:
            return None
        released = sum(self.reserve_pages(v, v.seq_len) for v in victims)
        for v in victims:
            self.retract(v)
            self.num_preemptions += 1
        order_by_priority(self.waiting, low_first)  # the victims queue behind ``req``
        return released

    def _preempt_gain(self, req: Req) -> int:
        """Pages retracting ``req`` makes available: those it owns (freed, or cached and evictable)
        and the decode reserve promised to it."""
        return len(req.pages) - req.num_cache_pages + self.reserve_pages(req, req.seq_len)

    # ---------------------------------------------------------- postprocess
    def postprocess(self, batch: ScheduledBatch, out: SampleOutput) -> StepEvents:
        """Advance KV lengths, append sampled tokens, finish requests that stop."""
        events = StepEvents()
        k = 0
        for req, extend, sample in zip(batch.reqs, batch.extend_lens, batch.sample):
            if not sample:
                req.kv_len += extend
                continue
            i = k
            k += 1
            if req.finished:  # aborted while its step ran
                continue
            was_prefill = batch.mode == ForwardMode.PREFILL
            if out.accepted is not None and extend > 1:  # a verify step
                events.updated.append(req)
                self._take_accepted(req, out.accepted[i], out.accepted_nodes[i] if out.accepted_nodes else None)
                continue
            req.kv_len += extend
            if req.sampling_params.max_new_tokens == 0:
                self.finish(req, FinishReason("length"))
                continue
            req.output_ids.append(out.token_ids[i])
            if req.return_logprob and out.logprobs is not None:
                req.output_logprobs.append(out.logprobs[i])
                if out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            events.updated.append(req)
            # a prefill server's one token must reach the decode side even if it is EOS
            reason = self.stop_check(req) if self.decode else None
            if reason is not None:
                self.finish(req, reason)
            elif was_prefill and req not in self.running:
                events.prefilled.append(req)
                if self.decode:
                    req.status = ReqStatus.RUNNING
                    self.running.append(req)
                else:  # its KV goes to a decode server; the loop hands it to its sender
                    req.status = ReqStatus.SENDING_KV
        if k != len(out.token_ids):
            raise ValueError(f"got {len(out.token_ids)} sampled tokens for {k} sampling requests")
        events.finished = self.drain_finished()
        return events

    def _take_accepted(self, req: Req, tokens: list[int], nodes: list[int] | None = None) -> None:
        """A verify step's outcome for ``req``: append ``tokens`` (accepted drafts, then the bonus)
        one at a time until one ends the request; the KV of the fed token and of the accepted drafts
        stays (every appended token but the last has its KV), the pages past that are freed.
        ``nodes``: a draft tree's accepted nodes; node ``j`` was stored in slot ``kv_len + 1 + j``,
        and the one at depth ``d`` stands at position ``kv_len + d``, so its K/V moves there first
        (by increasing depth: a move's source lies past every earlier move's destination)."""
        if nodes:
            ps = self.page_size
            slot = lambda p: req.pages[p // ps] * ps + p % ps  # noqa: E731
            moves = [(slot(req.kv_len + 1 + j), slot(req.kv_len + d)) for d, j in enumerate(nodes, 1) if j != d - 1]
            if moves:
                self.pool.move_slots([m[0] for m in moves], [m[1] for m in moves])
        reason = None
        # the verify step's matcher took the whole run, so a completed grammar is the run's last
        # token's doing: the tokens before it are checked without it (else EOS would be cut off)
        grammar = req.grammar if req.grammar is not None and req.grammar.terminated else None
        for k, t in enumerate(tokens):
            req.output_ids.append(t)
            if grammar is not None and k < len(tokens) - 1:
                req.grammar = None
                try:
                    reason = self.stop_check(req)
                finally:
                    req.grammar = grammar
            else:
                reason = self.stop_check(req)
            if reason is not None:
                break
        req.kv_len = req.seq_len - 1
        keep = self.pool.pages_for(req.seq_len)  # the next step writes the last token's KV
        if len(req.pages) > keep:
            self.pool.free(req.pages[keep:])
            del req.pages[keep:]
        if reason is not None:
            self.finish(req, reason)

    def add_prefilled(self, req: Req) -> None:
        """Decode mode: a request whose prompt KV is already in ``req.pages`` joins the decode batch."""
        self.reqs[req.rid] = req
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Prove that every used page is owned exactly once: by a live request or the cache."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        if self.lora_slots is not None:
            self.lora_slots.check_integrity()
        cache_pages = self.cache.held_pages()
        owned: list[int] = []
        for req in self.reqs.values():
            if req.status == ReqStatus.WAITING and req.pages:
                raise AssertionError(f"waiting {req} holds pages")
            cached = req.pages[: req.num_cache_pages]
            if not set(cached) <= cache_pages:
                raise AssertionError(f"{req} reads cache pages the cache no longer holds")
            owned.extend(req.pages[req.num_cache_pages :])
            if req.kv_len > len(req.pages) * self.page_size:
                raise AssertionError(f"{req} has KV beyond its pages")
        if len(set(owned)) != len(owned) or set(owned) & cache_pages or self.held_pages & (set(owned) | cache_pages):
            raise AssertionError("a page is owned twice")
        used = self.pool.used_pages()
        if set(owned) | cache_pages | self.held_pages != used:
            leaked = used - set(owned) - cache_pages - self.held_pages
            raise AssertionError(f"pages leaked (used but unowned): {sorted(leaked)[:8]}")
        if len(self.running) + (self.chunked is not None) > self.config.max_running_requests:
            raise AssertionError("more running requests than max_running_requests")
