"""The one loop of a scheduler rank: schedule, run the model, sample, report.

``SchedulerLoop`` owns the ModelRunner, the page pool's prefix cache and the
pure ``Scheduler``. It is single-threaded and knows nothing of sockets: the
caller (the offline ``Engine``'s thread, or a scheduler process reading ZMQ)
feeds it messages and ships the ``TokenOutput``s that ``step()`` returns.

The disaggregated modes (``PrefillLoop``, ``DecodeLoop``) receive their KV
manager as a constructor argument and hook in by overriding small methods of
the loop, never of the scheduler:

- ``decode=False`` (the prefill mode): the scheduler does not decode
  (``Scheduler(decode=False)``): prefilled requests are reported in the step's
  ``StepEvents.prefilled``, which the prefill loop reads to hand them to their
  KV senders.
- ``poll()``: called at the start of every step; the prefill mode polls its
  bootstrap and sending queues there, the decode mode its transfer queue,
  moving requests whose KV arrived into the decode batch with
  ``scheduler.add_prefilled``.
- ``admit(req)``: where a new request goes (prefill mode: bootstrap queue first;
  decode mode: preallocation).
- ``step_events()``: one step's outputs and the scheduler's ``StepEvents``; a
  request leaves by one path, ``StepEvents.finished``.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent import futures
import random
import time
from collections.abc import Callable

import torch

from pdserve.engine.constrained.grammar_masks import CompileJob, GrammarMasks, PendingMask
from pdserve.engine.constrained.thinking_budget import ThinkingBudget
from pdserve.engine.sched.batch_builder import build_forward_batch, input_logprob_rows
from pdserve.engine.config import EngineConfig
from pdserve.engine.lora_names import lora_id_of, parse_lora_paths
from pdserve.engine.model_executor.layers.lora_slots import LoraSlots
from pdserve.engine.messages import RankMetrics, SchedulerStats, TokenizedGenerateReq, TokenOutput
from pdserve.engine.model_executor import parallel
from pdserve.engine.sched.cache_factory import make_cache
from pdserve.engine.mem_cache.tier_metrics import hicache_families
from pdserve.engine.sched.request_log import RequestLog
from pdserve.engine.sched.sched_metrics import lora_families, scheduler_families
from pdserve.engine.sched.request import FinishReason, Req, ReqStatus
from pdserve.engine.sched.scheduler import ForwardMode, SampleOutput, ScheduledBatch, Scheduler, StepEvents
from pdserve.engine.sched.speculation import Speculation
from pdserve.engine.sched.stage_recorder import StageRecorder
from pdserve.engine.speculative.proposer import chain_parents
from pdserve.engine.speculative.spec_metrics import SpecStats
from pdserve.engine.speculative_names import NEXTN
from pdserve.engine.sched.stop_checker import StopChecker
from pdserve.kernels.sampling import (
    SamplingTensors,
    apply_penalties,
    gather_logprobs,
    greedy_ids,
    processed_logits,
    sample,
    seeded_uniform,
)

logger = logging.getLogger(__name__)


# a rank with nothing to compute sleeps between polls of its queues, from the first to the last
# value, doubling while nothing changes: quick to react, yet off the CPU the model threads need
QUEUE_POLL_S = (0.0005, 0.004)


class SchedulerLoop:
    SIDE = "colocated"  # what --log-requests lines call this kind of rank

    def __init__(self, config: EngineConfig, dp_rank: int = 0, runner=None, decode: bool = True):
        """``decode=False``: a prefill server's rank (see ``Scheduler``)."""
        if runner is None:
            from pdserve.engine.model_executor.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.config = config
        self.dp_rank = dp_rank
        self.runner = runner
        self.arch = runner.arch
        self.tokenizer = runner.tokenizer
        self.pool = runner.page_pool
        self.device = runner.device
        self.cache = make_cache(self.pool, config, *_namespace_of(runner))
        self.stop_checker = StopChecker(self.arch.eos_token_ids, self.tokenizer)
        # --enable-lora: which adapters sit in the model's slots, and each adapter's cache namespace
        lora_slots = LoraSlots(config.max_loras_per_batch) if config.enable_lora else None
        self.lora_ids = {name: lora_id_of(name, path) for name, path in parse_lora_paths(config.lora_paths).items()}
        for name, path in parse_lora_paths(config.lora_paths).items():
            self.cache.name_adapter(self.lora_ids[name], path)
        self.num_lora_host_loads = len(self.lora_ids)  # read at start; /load_lora_adapter adds
        self.scheduler = Scheduler(config, self.pool, self.cache, self.stop_checker, decode=decode,
                                   lora_slots=lora_slots)
        # structured output: xgrammar is loaded on the first request that names a grammar
        self.grammars = GrammarMasks(self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)
        self._compiling: dict[str, tuple[Req, CompileJob]] = {}  # rid -> (req, its grammar's compilation)
        # speculative decoding (docs/SPECULATIVE.md): decode steps verify the proposer's drafts
        self.spec = Speculation(config, runner, self.grammars) if config.speculative_algorithm and decode else None
        if config.speculative_algorithm and not decode and config.speculative_algorithm != NEXTN:
            logger.warning("speculative_algorithm %s is ignored here: a prefill server computes the first token "
                           "only; speculation runs on the decode server", config.speculative_algorithm)
        self.rng = random.Random(config.random_seed)  # draws of requests without a seed
        self._outbox: list[TokenOutput] = []
        # where the rank's loop sends outputs at once: the outbox (outputs that need no forward, such
        # as a PD decode's first token, which came from the prefill) leaves before a step's forward
        # instead of with its outputs, one step later (None: with the step's outputs)
        self.ship_early: Callable[[list[TokenOutput]], None] | None = None
        self.num_steps = 0
        self._idle_sleep = QUEUE_POLL_S[0]
        self._dirty = False  # PD modes: something ran since the last idle integrity check
        # TP rank 0 speaks for its TP group, which runs the same requests in lockstep
        self.request_log = RequestLog(self.SIDE, dp_rank, config.log_requests and parallel.tp_rank() == 0)
        # traced requests' stage timelines (--enable-trace), recorded by TP rank 0 only
        self.stages = StageRecorder(dp_rank, parallel.tp_rank() == 0)

    # ------------------------------------------------------------- overridables
    def poll(self) -> None:
        """Called at the start of every step: the PD modes advance their queues here."""

    def admit(self, req: Req) -> FinishReason | None:
        """Where a validated new request goes; returns a reason if it can never run."""
        return self.scheduler.add(req)

    def layer_hook(self, batch: ScheduledBatch) -> contextlib.AbstractContextManager[Callable[[int], None] | None]:
        """Entered around the batch's forward; what it yields is called after each layer stored its KV
        (the prefill mode's layer-wise send). Default: nothing."""
        return contextlib.nullcontext()

    # ----------------------------------------------------------------- inputs
    def add_request(self, msg: TokenizedGenerateReq) -> None:
        """Queue a tokenized request. A request that cannot run ends at once with an error output."""
        req = Req(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            bootstrap=msg.bootstrap,
            logprob_start_len=msg.logprob_start_len if msg.return_logprob else -1,
            health_probe=msg.health_probe,
            priority=msg.priority,
            lora_name=msg.lora_path,
            lora_id=self.lora_ids.get(msg.lora_path, 0),
        )
        if msg.trace:
            self.stages.start(req)
        if req.lora_name is not None and req.lora_name not in self.lora_ids:
            # unloaded after the front end checked the name: the caller's error, not the server's
            self._queue(req, f"lora_path: unknown LoRA adapter {req.lora_name!r}", 400)
            return
        error = self.validate(req)
        if error is None and req.sampling_params.grammar is not None and parallel.tp_size() == 1:
            # off the scheduler thread; TP ranks admit in lockstep, so they compile in place
            self._compiling[req.rid] = (req, self.grammars.compile(req.sampling_params.grammar))
            return
        if error is None:
            error = self._attach_grammar(req)
        self._queue(req, error, 400 if error and req.sampling_params.grammar is not None else 500)

    def _queue(self, req: Req, error: str | None, status: int = 500) -> None:
        """Admit a validated request (its grammar attached), or end it with ``error``."""
        if error is None:
            self.request_log.mark(req.rid, "queued")
            self.cache.start_prefetch(req.rid, req.cache_key(len(req.fill_ids)))  # storage tier: fetch while it waits
        reason = FinishReason("error", message=error, status=status) if error else self.admit(req)
        if reason is not None:
            self.cache.cancel_prefetch(req.rid)
            req.finish_reason = reason
            req.status = ReqStatus.FINISHED
            self._outbox.append(self._output(req))

    def validate(self, req: Req) -> str | None:
        """A message naming what is wrong with the request, or None."""
        if not req.input_ids:
            return "input_ids is empty"
        if req.rid in self.scheduler.reqs or req.rid in self._compiling:
            return f"rid {req.rid!r} is already in flight"
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in req.input_ids):
            return f"input_ids has a token outside the vocabulary [0, {vocab})"
        if len(req.input_ids) > self.arch.max_context_len:
            return f"prompt of {len(req.input_ids)} tokens is longer than the context ({self.arch.max_context_len})"
        try:
            req.sampling_params.validate(vocab)
        except ValueError as exc:
            return str(exc)
        if req.top_logprobs_num < 0:
            return "top_logprobs_num must be >= 0"
        if req.lora_name is not None and req.lora_name not in self.lora_ids:
            return f"lora_path: unknown LoRA adapter {req.lora_name!r}"
        return None

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled go on to admission; one compiling for longer than
        ``grammar_compile_timeout`` ends with a 400 naming the grammar (the compile thread finishes
        it anyway: xgrammar cannot be stopped; the grammar size cap bounds how long)."""
        now = time.monotonic()
        for rid, (req, job) in list(self._compiling.items()):
            if job.future.done():
                del self._compiling[rid]
                try:
                    req.grammar = job.future.result()
                    self._budget_thinking(req)
                    error = None
                except ValueError as exc:
                    error = str(exc)
                except Exception as exc:  # noqa: BLE001 - the request carries it; the rank goes on
                    error = f"{req.sampling_params.grammar[0]} did not compile: {type(exc).__name__}: {exc}"
                self._queue(req, error, 400)
            elif job.overdue(now, self.config.grammar_compile_timeout):
                del self._compiling[rid]
                kind = req.sampling_params.grammar[0]
                self._queue(req, f"{kind}: the grammar did not compile within {self.config.grammar_compile_timeout:g} s "
                            "(--grammar-compile-timeout); simplify it", 400)

    def _attach_grammar(self, req: Req) -> str | None:
        """Give a constrained request its matcher (compiled in place) and its thinking budget; a
        message when its grammar does not compile."""
        grammar = req.sampling_params.grammar
        if grammar is not None:
            try:
                req.grammar = self.grammars.matcher(grammar)
            except ValueError as exc:
                return str(exc)
        self._budget_thinking(req)
        return None

    def _budget_thinking(self, req: Req) -> None:
        """Wrap the request's matcher (or none) in its reasoning budget, when it has one."""
        sp = req.sampling_params
        if sp.thinking_budget is not None:
            end_ids = self.tokenizer.encode(sp.thinking_end, add_special_tokens=False)
            req.grammar = ThinkingBudget(req.grammar, end_ids, sp.thinking_end, sp.thinking_budget,
                                         self.tokenizer.decode, sp.thinking_start)

    def abort(self, rid: str, reason: str = "aborted") -> bool:
        """End a request and free its pages; its final output comes from the next ``step``."""
        compiling = self._compiling.pop(rid, None)
        if compiling is not None:
            self.finish_unscheduled(compiling[0], FinishReason("abort", message=reason))
            return True
        return self.scheduler.abort(rid, reason) is not None

    def flush_cache(self) -> bool:
        """Drop the prefix cache; only when idle, as SGLang does."""
        if self.scheduler.has_work():
            return False
        self.cache.flush()
        return True

    def weights_changed(self) -> None:
        """After a weight update (idle): the cached KV came from the old weights, so the cache is
        flushed, and a storage tier reads and writes under the new weights' namespace."""
        self.cache.flush()
        set_namespace = getattr(self.cache, "set_namespace", None)
        if set_namespace is not None:
            from pdserve.engine.mem_cache.storage_key import kv_namespace

            path, kv_start = _namespace_of(self.runner)
            set_namespace(kv_namespace(path, self.pool.layout(), kv_start))

    def live_requests(self) -> list[Req]:
        """Every request the rank holds: admitted (waiting, running) or compiling its grammar."""
        return list(self.scheduler.reqs.values()) + [req for req, _ in self._compiling.values()]

    # ------------------------------------------------------------------- loop
    def has_work(self) -> bool:
        return (bool(self._outbox) or bool(self._compiling) or self.scheduler.has_work()
                or bool(self.scheduler.newly_finished))

    def step(self) -> list[TokenOutput]:
        """One scheduling round: at most one model forward. Returns the outputs to ship."""
        return self.step_events()[0]

    def step_events(self) -> tuple[list[TokenOutput], StepEvents]:
        """``step``, also returning what the scheduler reported (prefilled, finished, updated)."""
        self.poll()
        if self._compiling:
            self._admit_compiled()
        outputs, self._outbox = self._outbox, []
        batch = self.scheduler.schedule()
        if batch is not None:
            if outputs and self.ship_early is not None:
                self.ship_early(outputs)
                outputs = []
            self.num_steps += 1
            if self.spec is not None:
                self.spec.attach(batch, self.scheduler)
            t0 = time.perf_counter()
            traced_start = time.monotonic() if self.stages.live else None  # None: no traced request here
            sampled = self.run_batch(batch)
            if self.spec is not None and self.spec.wants_hidden:
                self.spec.observe(batch, sampled)
            if batch.mode is ForwardMode.PREFILL:
                self.cache.observe_compute(time.perf_counter() - t0, batch.num_tokens)
            if traced_start is not None:
                self.stages.on_forward(batch, traced_start, time.monotonic())
            events = self.scheduler.postprocess(batch, sampled)
        else:
            events = StepEvents(finished=self.scheduler.drain_finished())
            s = self.scheduler
            if self._compiling and not s.waiting and not s.running and not outputs:
                # only grammars compiling: wait for one (or its deadline), not spin
                futures.wait([job.future for _, job in self._compiling.values()], timeout=QUEUE_POLL_S[1],
                             return_when=futures.FIRST_COMPLETED)
            elif s.waiting and not s.running and s.chunked is None:
                # the queue head waits: on its storage prefetch (woken when a fetch lands), or for
                # pages its KV senders hold (a short sleep): yield the CPU and the GIL, not spin
                if not self.cache.wait_for_prefetch(s.waiting[0].rid, QUEUE_POLL_S[1]):
                    time.sleep(QUEUE_POLL_S[0])
        done = set(map(id, events.finished))
        if self.spec is not None:
            for req in events.finished:
                self.spec.release(req)
        for req in events.updated:
            if req.stream and id(req) not in done:
                outputs.append(self._output(req))
        outputs.extend(self._output(req) for req in events.finished)
        return outputs, events

    def run_batch(self, batch: ScheduledBatch) -> SampleOutput:
        loads = self.scheduler.drain_lora_loads()
        if loads:  # adapters given a slot at this batch's admission
            self.runner.load_lora(loads)
        fb = build_forward_batch(batch, self.pool.page_size, self.device)
        if batch.drafts is not None:
            return self._run_verify(batch, fb)
        reqs = batch.sampled_reqs
        mask = self.grammars.begin([r.grammar for r in reqs])  # filled while the forward runs
        with torch.inference_mode():
            with self.layer_hook(batch) as after_layer:
                logits = self.runner.forward(fb, after_layer)  # [num_sampled + prompt-logprob rows, vocab] float32
            if logits.shape[0] > len(reqs):
                self._gather_input_logprobs(batch, logits[len(reqs) :])
            return self.sample(reqs, logits[: len(reqs)], mask)

    def _run_verify(self, batch: ScheduledBatch, fb) -> SampleOutput:
        """A decode step carrying drafts: one forward scores every fed token; requests without a
        draft sample their one row as usual, the others keep their accepted run (``Speculation``)."""
        reqs, drafts = batch.reqs, batch.drafts
        plain = [i for i, d in enumerate(drafts) if not d]
        mask = self.grammars.begin([reqs[i].grammar for i in plain])
        with torch.inference_mode():
            logits = self.runner.forward(fb)  # [sum(1 + len(draft)), vocab] float32
            starts, row = [], 0
            for d in drafts:
                starts.append(row)
                row += 1 + len(d)
            plain_out = self.sample([reqs[i] for i in plain], logits[[starts[i] for i in plain]], mask)
            spec = [i for i, d in enumerate(drafts) if d]
            rows = [logits[starts[i] : starts[i] + 1 + len(drafts[i])] for i in spec]  # 1 + nodes each
            parents = batch.draft_parents or [chain_parents(len(d)) for d in drafts]
            gained, paths = self.spec.verify([reqs[i] for i in spec], [drafts[i] for i in spec],
                                             [parents[i] for i in spec], rows, self.rng)
        accepted: list[list[int]] = [[] for _ in reqs]
        for k, i in enumerate(plain):
            accepted[i] = [plain_out.token_ids[k]]
        for k, i in enumerate(spec):
            accepted[i] = gained[k]
        out = SampleOutput([a[0] for a in accepted], accepted=accepted)
        if batch.draft_parents is not None:  # some draft is a tree: its accepted nodes move their KV
            out.accepted_nodes = [[] for _ in reqs]
            for k, i in enumerate(spec):
                out.accepted_nodes[i] = paths[k]
        if plain_out.logprobs is not None:
            out.logprobs, out.top_logprobs = [0.0] * len(reqs), [[] for _ in reqs]
            for k, i in enumerate(plain):
                out.logprobs[i] = plain_out.logprobs[k]
                out.top_logprobs[i] = plain_out.top_logprobs[k] if plain_out.top_logprobs else []
        return out

    def _gather_input_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        rows = input_logprob_rows(batch)
        for req in batch.reqs:
            if req.wants_input_logprobs and req.logprob_start_len + len(req.input_logprobs) == 0:
                req.input_logprobs.append(None)  # the first prompt token has no prefix to score it
        targets = torch.tensor([batch.reqs[i].input_ids[p] for i, _, p in rows], device=logits.device)
        lps = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.view(-1, 1)).squeeze(1).tolist()
        for (i, _, _), lp in zip(rows, lps):
            batch.reqs[i].input_logprobs.append(lp)

    def sample(self, reqs: list[Req], logits: torch.Tensor, mask: PendingMask | None = None) -> SampleOutput:
        """Sample one token per request (row); ``mask``: the grammar mask of the constrained rows,
        applied first, and their matchers then accept the sampled tokens."""
        if not reqs:
            return SampleOutput([])
        if mask is not None and self._greedy_fast_path(reqs):
            # greedy: the unmasked argmax stands wherever the grammar allows it, so only rows where
            # it does not are masked and taken again, instead of masking the whole vocabulary of every row
            ids = greedy_ids(logits)
            rows = mask.forbidden_rows(ids)
            if rows:
                mask.apply(logits, rows)
                ids[rows] = greedy_ids(logits[rows])
            out = SampleOutput(ids.tolist())
        else:
            if mask is not None:
                mask.apply(logits)
            out = self._sample(reqs, logits)
        for req, token_id in zip(reqs, out.token_ids):
            if req.grammar is not None:
                req.grammar.accept(token_id)
        return out

    @staticmethod
    def _greedy_fast_path(reqs: list[Req]) -> bool:
        """Every row takes its argmax: greedy, no penalties, no logprobs."""
        params = [r.sampling_params for r in reqs]
        return not any(r.return_logprob for r in reqs) and all(p.is_greedy for p in params) and not _any_penalty(params)

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> SampleOutput:
        if self._greedy_fast_path(reqs):
            return SampleOutput(greedy_ids(logits).tolist())  # the common greedy fast path
        params = [r.sampling_params for r in reqs]
        want_logprob = any(r.return_logprob for r in reqs)
        t = SamplingTensors.from_params(params, logits.shape[-1], logits.device)
        if t.need_penalties:
            logits = apply_penalties(logits, [r.input_ids for r in reqs], [r.output_ids for r in reqs], t)
        uniforms = torch.tensor(
            [
                seeded_uniform(p.seed, len(r.output_ids)) if p.seed is not None else self.rng.random()
                for r, p in zip(reqs, params)
            ],
            dtype=torch.float32,
            device=logits.device,
        )
        ids = sample(logits, t, uniforms)
        out = SampleOutput(ids.tolist())
        if want_logprob:
            top_n = max(r.top_logprobs_num for r in reqs)
            lps, tops = gather_logprobs(processed_logits(logits, t), ids, top_n)
            out.logprobs = lps
            out.top_logprobs = [top[: r.top_logprobs_num] for r, top in zip(reqs, tops)]
        return out

    def wait_on_peers(self, progressed: bool) -> None:
        """Only waiting on peers (bootstrap, transfers): sleep instead of spinning, backing off while idle."""
        self._idle_sleep = QUEUE_POLL_S[0] if progressed else min(self._idle_sleep * 2, QUEUE_POLL_S[1])
        time.sleep(self._idle_sleep)

    def idle_tail(self, outputs: list[TokenOutput]) -> None:
        """PD modes, after a step with nothing scheduled next: wait on peers (backing off), or once
        all is quiet after activity, check that every page is accounted for."""
        if self.scheduler.has_work():
            return
        if self.has_work():
            self.wait_on_peers(bool(outputs))
        elif self._dirty and not outputs:
            self._dirty = False
            self.check_integrity()

    def finish_unscheduled(self, req: Req, reason: FinishReason) -> None:
        """End a request the scheduler never held (still queued outside it, e.g. for a PD peer)."""
        self.cache.cancel_prefetch(req.rid)
        req.finish_reason = reason
        req.status = ReqStatus.FINISHED
        self._outbox.append(self._output(req))

    # ---------------------------------------------------------------- outputs
    def _output(self, req: Req) -> TokenOutput:
        start = req.num_sent
        req.num_sent = len(req.output_ids)
        reason = req.finish_reason
        out = TokenOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[start:],
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            finished=reason is not None,
        )
        if self.spec is not None:
            out.spec_verify_ct = req.spec_verify_ct
            out.spec_draft_token_num = req.spec_proposed_tokens
            out.spec_accept_token_num = req.spec_accepted_tokens
        if req.return_logprob:
            out.new_logprobs = req.output_logprobs[start:]
            out.new_top_logprobs = req.output_top_logprobs[start:]
            if start == 0:
                out.input_logprobs = list(req.input_logprobs)
        if reason is not None:
            out.finish_reason = reason.type
            out.matched_stop = reason.matched
            out.error = reason.message
            out.error_status = reason.status
            out.stages = self.stages.finish(req)
            self.request_log.end(req)
        return out

    # ------------------------------------------------------------------ state
    def stats(self) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(
            dp_rank=self.dp_rank,
            num_running=len(s.running) + (s.chunked is not None),
            num_waiting=len(s.waiting),
            num_free_pages=s.free_pages(),
            num_total_pages=self.pool.capacity,
            page_size=self.pool.page_size,
            num_running_tokens=sum(r.seq_len for r in s.running) + (s.chunked.seq_len if s.chunked else 0),
            num_queued_tokens=sum(r.seq_len for r in s.waiting),
        )

    def rank_metrics(self) -> RankMetrics | None:
        """This rank's own Prometheus families (the hierarchical cache's tiers; the PD modes add their
        KV rooms)."""
        return RankMetrics(self.dp_rank, parallel.tp_rank(), hicache_families(self.cache) + self.spec_families()
                          + self.sched_families() + self.runner.model_families())

    def spec_families(self) -> list:
        """Speculation's families (``spec_metrics``), at 0 on a rank that does not speculate: a dashboard
        reads 0, not "no data"."""
        return (self.spec.stats if self.spec is not None else SpecStats()).families()

    def sched_families(self) -> list:
        """The scheduler's families (``sched_metrics``): its preemptions by reason, its LoRA adapter loads."""
        return (scheduler_families(self.scheduler.num_retractions, self.scheduler.num_preemptions)
                + lora_families(self.num_lora_host_loads, self.scheduler.num_lora_slot_loads))

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        """Release what the loop holds beyond memory (the storage tier's thread; the PD modes: their
        KV manager)."""
        self.cache.close()
        if self.spec is not None:
            self.spec.close()


def _namespace_of(runner) -> tuple[str, int]:
    """The model path and first KV head of ``runner`` (a storage tier's key namespace)."""
    source = getattr(runner, "model_source", None)
    tp = getattr(runner, "tp", None)
    return (source.path if source is not None else ""), (tp.kv_start if tp is not None else 0)


def _any_penalty(params) -> bool:
    return any(
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
    )
