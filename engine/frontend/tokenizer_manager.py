"""The main process's side of the engine: tokenize, dispatch, collect, detokenize.

``TokenizerManager`` owns the per-sequence states and the choice of DP rank,
and reaches the scheduler ranks through a ``RankTransport`` (ZMQ to scheduler
processes in ``pdserve serve``, a thread in the offline ``Engine``: both front
ends are this class). ``submit(seqs)`` tokenizes and validates every sequence
of a request before sending any and returns a ``RequestHandle`` that yields
``(SeqState, Delta)`` as outputs arrive; closing the handle early (a client
that disconnects cancels its handler) aborts the unfinished sequences in
their schedulers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from pdserve.engine.lora_names import parse_lora_paths
from pdserve.engine.text.detokenizer import Detokenizer
from pdserve.engine.messages import (
    AbortReq,
    RankMetrics,
    ControlReq,
    ControlResult,
    SchedulerError,
    SchedulerOutput,
    SchedulerReady,
    SchedulerStats,
    TokenizedGenerateReq,
    TokenOutput,
)
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.frontend.sequences import SequenceSpec
from pdserve.engine.text.prompt import encode_prompt, prompt_chars
from pdserve.engine.frontend.value_checks import RequestLimits
from pdserve.engine.pd_rules import local_prefill_refusal
from pdserve.engine.frontend.rank_transport import RankTransport
from pdserve.engine.model_executor.sampling_defaults import model_sampling_defaults
from pdserve.engine.frontend.seq_state import Delta, SeqState, TokenLogprob
from pdserve.engine.server_config import ServerConfig
from pdserve.engine.frontend.request_trace import SeqTrace, record_sequence
from pdserve.engine.tracing import Tracer, make_tracer

logger = logging.getLogger(__name__)

# No tokenizer makes a token of this many characters on average: a longer text cannot fit the
# context, and is refused before tokenizing it costs anything
MAX_CHARS_PER_TOKEN = 32


class RankFailed(Exception):
    """A scheduler rank reported an error or died."""


class TokenizerManager:
    def __init__(self, config: ServerConfig, tokenizer, metrics: ServerMetrics, transport: RankTransport):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.dp_size = config.dp_size
        self.transport = transport
        self.ready: list[SchedulerReady | None] = [None] * self.dp_size
        self.stats: list[SchedulerStats | None] = [None] * self.dp_size
        # when each rank's stats last came (they come at least every second from a looping rank)
        self.last_heard = [time.monotonic()] * self.dp_size
        self.last_sent = [0.0] * self.dp_size  # when each rank was last sent a request, abort or control
        self.rank_metrics: dict[tuple[int, int], RankMetrics] = {}  # (dp, tp) -> the latest
        self.inflight = [0] * self.dp_size
        # the LoRA adapters served, name -> path: --lora-paths, then /load_lora_adapter's and /unload_lora_adapter's
        self.lora_paths: dict[str, str] = parse_lora_paths(config.engine.lora_paths)
        self._rr = 0
        self._seqs: dict[str, tuple[SeqState, asyncio.Queue]] = {}
        self._rooms: dict[int, str] = {}  # bootstrap_room -> rid, while in flight (PD modes)
        self._start_failure: str | None = None
        self._ready_changed = asyncio.Event()
        self.dead_reason: str | None = None
        self._tok_cache: dict[int, str] = {}
        # the OpenAI endpoints' defaults for what a request leaves out (--sampling-defaults)
        self.sampling_defaults = (
            model_sampling_defaults(config.engine.model_path) if config.sampling_defaults == "model" else {}
        )
        self._control_ids = itertools.count(1)
        # tokenization runs here, off the event loop (the Rust tokenizer releases the GIL); one
        # thread: requests are tokenized in arrival order and the tokenizer is never shared
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._control: dict[int, list[asyncio.Future]] = {}  # req_id -> one future per DP rank
        # --enable-trace: each sequence's stage spans (request_trace.py); None: tracing off
        self.tracer: Tracer | None = make_tracer(config.trace, "pdserve-" + config.disaggregation_mode)
        self._traces: dict[str, SeqTrace] = {}  # rid -> its spans' parent, while in flight (tracing on)

    # --- start and stop --------------------------------------------------------------------

    async def wait_ready(self, timeout: float, alive) -> None:
        """Start receiving, then wait for every rank's SchedulerReady; ``alive()`` False (a rank
        died) aborts the wait."""
        self.transport.start(self.on_messages)
        deadline = time.monotonic() + timeout
        while not all(self.ready):
            if self._start_failure is not None:
                raise RankFailed(self._start_failure)
            if not alive():
                raise RankFailed("a scheduler process exited during start-up")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"scheduler ranks not ready within {timeout:.0f} s")
            self._ready_changed.clear()
            try:
                await asyncio.wait_for(self._ready_changed.wait(), min(0.5, left))
            except asyncio.TimeoutError:
                pass

    def close(self) -> None:
        self.transport.close()
        if self.tracer is not None:
            self.tracer.shutdown()  # exports the spans still batched

    # --- model facts -----------------------------------------------------------------------

    @property
    def model_info(self) -> SchedulerReady:
        return self.ready[0]

    @property
    def max_total_num_tokens(self) -> int:
        return min(r.max_total_num_tokens for r in self.ready)

    def limits(self) -> RequestLimits:
        c = self.config
        names = {c.model_name, "default"}
        if c.engine.model_path:
            names.add(c.engine.model_path)
        return RequestLimits(
            model_names=frozenset(names),
            max_n=c.max_n,
            dp_size=self.dp_size,
            vocab_size=self.model_info.vocab_size,
            disaggregation_mode=c.disaggregation_mode,
            max_local_prefill_tokens=c.max_local_prefill_tokens if c.disaggregation_mode == "decode" else 0,
            bootstrap_allowlist=c.kv_transfer.bootstrap_allowlist if c.disaggregation_mode == "decode" else "",
            sampling_defaults=self.sampling_defaults,
            tool_call_parser=c.tool_call_parser,
            enable_priority_scheduling=c.engine.enable_priority_scheduling,
            reasoning_parser=c.reasoning_parser,
            lora_adapters=frozenset(self.lora_paths),
        )

    def token_str(self, token_id: int) -> str:
        s = self._tok_cache.get(token_id)
        if s is None:
            s = self._tok_cache[token_id] = self.tokenizer.decode([token_id])
        return s

    # --- requests --------------------------------------------------------------------------

    def _prepare(self, spec: SequenceSpec, ids: list[int]) -> SeqState:
        info = self.model_info
        ctx = info.max_context_len
        if not ids:
            raise RequestError(f"{spec.prompt_param} is empty after tokenization", param=spec.prompt_param)
        if len(ids) >= ctx:
            raise RequestError(
                f"{spec.prompt_param} has {len(ids)} tokens; the model's context is {ctx} tokens "
                "and must leave room for the output",
                param=spec.prompt_param,
                code="context_length_exceeded",
            )
        room = min(ctx, self.max_total_num_tokens) - len(ids)
        sp = spec.sampling_params
        if not spec.max_tokens_given:
            if room < 1:
                raise RequestError(
                    f"{spec.prompt_param} has {len(ids)} tokens, more than the KV cache holds",
                    param=spec.prompt_param,
                    code="context_length_exceeded",
                )
            sp = msgspec.structs.replace(sp, max_new_tokens=room)
            spec.sampling_params = sp
        elif len(ids) + sp.max_new_tokens > ctx:
            raise RequestError(
                f"{spec.max_tokens_param} = {sp.max_new_tokens} with a {len(ids)}-token prompt exceeds "
                f"the model's context of {ctx} tokens",
                param=spec.max_tokens_param,
                code="context_length_exceeded",
            )
        elif len(ids) + sp.max_new_tokens > self.max_total_num_tokens:
            raise RequestError(
                f"{spec.max_tokens_param} = {sp.max_new_tokens} with a {len(ids)}-token prompt exceeds "
                f"the KV cache of {self.max_total_num_tokens} tokens",
                param=spec.max_tokens_param,
                code="context_length_exceeded",
            )
        stops = [] if spec.no_stop_trim else sp.stop
        detok = Detokenizer(self.tokenizer, stops, sp.skip_special_tokens)
        return SeqState(spec=spec, input_ids=ids, detok=detok, prompt_tokens=len(ids))

    def _placed_by_room(self, spec: SequenceSpec) -> bool:
        return (spec.routed_dp_rank is None and spec.bootstrap is not None
                and self.config.disaggregation_mode == "prefill")

    def _pick_rank(self, spec: SequenceSpec) -> int:
        if spec.routed_dp_rank is not None:
            return spec.routed_dp_rank
        if self._placed_by_room(spec):
            return spec.bootstrap.room % self.dp_size
        # least loaded by sequences in flight; ties go round robin so idle ranks share the work
        n = self.dp_size
        rank = min(range(n), key=lambda r: (self.inflight[r], (r - self._rr) % n))
        self._rr = (rank + 1) % n
        return rank

    async def in_tokenizer_thread(self, fn, *args):
        """``fn(*args)`` on the tokenizer's thread, so that a long text never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def check_prompt_chars(self, spec: SequenceSpec) -> None:
        """Refuse a prompt whose characters cannot fit the context, before tokenizing it."""
        ctx = self.model_info.max_context_len
        chars = prompt_chars(spec.prompt)
        if chars > ctx * MAX_CHARS_PER_TOKEN:
            raise RequestError(
                f"{spec.prompt_param} has {chars} characters; the model's context of {ctx} tokens takes at most "
                f"{ctx * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} a token)",
                param=spec.prompt_param, code="context_length_exceeded")

    async def submit_async(self, seqs: list[SequenceSpec], batch: bool = False) -> "RequestHandle":
        """``submit`` for the event loop: the prompts' characters checked against the context, then
        tokenized on the tokenizer's thread."""
        prompts: dict[int, object] = {}
        for spec in seqs:
            if spec.prompt_index not in prompts:
                self.check_prompt_chars(spec)
                prompts[spec.prompt_index] = spec.prompt

        def encode_all() -> dict[int, list[int]]:
            return {i: encode_prompt(self.tokenizer, p) for i, p in prompts.items()}

        if self.tracer is None:
            return self.submit(seqs, batch, await self.in_tokenizer_thread(encode_all))
        start = time.monotonic()
        encoded = await self.in_tokenizer_thread(encode_all)
        trace = SeqTrace(self.tracer.current(), start, time.monotonic())
        # a sampled trace asks the ranks for the stage timeline of each sequence
        handle = self.submit(seqs, batch, encoded, traced=self.tracer.sampled(trace.parent))
        for st in handle.states:  # one each: a sequence's stages and detokenizer time are its own
            self._traces[st.rid] = dataclasses.replace(trace)
        return handle

    def submit(self, seqs: list[SequenceSpec], batch: bool = False,
               encoded: dict[int, list[int]] | None = None, traced: bool = False) -> "RequestHandle":
        """Tokenize (unless ``encoded`` holds each prompt's ids, by prompt index) and validate every
        sequence (RequestError on the first bad one), then send all. ``traced``: the ranks record
        each sequence's stage timeline (``TokenizedGenerateReq.trace``)."""
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, status=503, type="server_error", code="unavailable")
        states: list[SeqState] = []
        ids_by_prompt: dict[int, list[int]] = {}
        for spec in seqs:
            if spec.prompt_index not in ids_by_prompt:
                ids = (encoded or {}).get(spec.prompt_index)
                ids_by_prompt[spec.prompt_index] = encode_prompt(self.tokenizer, spec.prompt) if ids is None else ids
                n = len(ids_by_prompt[spec.prompt_index])
                limit = self.config.max_local_prefill_tokens
                local = spec.bootstrap is None and not spec.health_probe
                if local and self.config.disaggregation_mode == "decode" and n > limit:
                    raise RequestError(local_prefill_refusal(n, limit), param="bootstrap_room")
            states.append(self._prepare(spec, ids_by_prompt[spec.prompt_index]))
        for st in states:
            if st.rid in self._seqs:
                raise RequestError(f"rid {st.rid!r} is already in flight", param="rid")
        rooms = [st.spec.bootstrap.room for st in states if st.spec.bootstrap is not None]
        for room in rooms:
            if room in self._rooms or rooms.count(room) > 1:
                raise RequestError(f"bootstrap_room {room} is already in flight", param="bootstrap_room")
        num_prompts = len(ids_by_prompt)
        handle = RequestHandle(self, states)
        rank_by_prompt: dict[int, int] = {}
        for st in states:
            # every choice of one prompt goes to the same rank, where they share the prompt's cache;
            # a prefill server places each by its own room, where its decode peer looks for it
            if self._placed_by_room(st.spec):
                st.dp_rank = self._pick_rank(st.spec)
            else:
                if st.spec.prompt_index not in rank_by_prompt:
                    rank_by_prompt[st.spec.prompt_index] = self._pick_rank(st.spec)
                st.dp_rank = rank_by_prompt[st.spec.prompt_index]
            st.num_prompts_in_batch = num_prompts if batch else 0
            self._seqs[st.rid] = (st, handle.queue)
            if st.spec.bootstrap is not None:
                self._rooms[st.spec.bootstrap.room] = st.rid
            self.inflight[st.dp_rank] += 1
            self.metrics.on_dispatch(st.dp_rank)
            spec = st.spec
            req = TokenizedGenerateReq(
                rid=st.rid,
                input_ids=st.input_ids,
                sampling_params=spec.sampling_params,
                stream=True,
                return_logprob=spec.return_logprob,
                top_logprobs_num=spec.top_logprobs_num,
                logprob_start_len=spec.logprob_start_len,
                bootstrap=spec.bootstrap,
                health_probe=spec.health_probe,
                priority=spec.priority,
                lora_path=spec.lora_path,
                trace=traced,
            )
            self._send(st.dp_rank, req)
        return handle

    def _abort_state(self, st: SeqState, reason: str) -> None:
        if self._seqs.pop(st.rid, None) is None:
            return
        if self.dead_reason is None:
            self._send(st.dp_rank, AbortReq(rid=st.rid, reason=reason))
        self._finish(st, "abort", None, reason)

    def abort(self, rid: str, reason: str = "aborted by /abort_request") -> int:
        """Abort a request by rid (its choices too); returns how many sequences it ended."""
        hits = [
            entry for key, entry in list(self._seqs.items()) if key == rid or key.startswith(rid + "-")
        ]
        for st, queue in hits:
            self._abort_state(st, reason)
            queue.put_nowait((st, Delta("", [], [], True)))
        return len(hits)

    def abort_all(self, reason: str = "aborted by /abort_request") -> int:
        rids = list(self._seqs)
        return sum(self.abort(rid, reason) for rid in rids if rid in self._seqs)

    async def control(self, req: ControlReq) -> list[ControlResult]:
        """Send a control request to every DP rank and wait for each one's answer (in rank order).
        A rank that dies meanwhile raises ``RankFailed``."""
        if self.dead_reason is not None:
            raise RankFailed(self.dead_reason)
        req = msgspec.structs.replace(req, req_id=next(self._control_ids))
        loop = asyncio.get_running_loop()
        futures = self._control[req.req_id] = [loop.create_future() for _ in range(self.dp_size)]
        try:
            for rank in range(self.dp_size):
                self._send(rank, req)
            return list(await asyncio.gather(*futures))
        finally:
            self._control.pop(req.req_id, None)

    def _send(self, rank: int, msg) -> None:
        self.last_sent[rank] = time.monotonic()
        self.transport.send(rank, msg)

    def stalled_ranks(self, timeout: float) -> list[tuple[int, float]]:
        """(DP rank, seconds silent) of each rank that has work (requests in flight, or a message
        sent since it was last heard from) and has not been heard from for longer than
        ``timeout``: its scheduler is wedged (stopped, stuck in a step), not idle."""
        now = time.monotonic()
        out = []
        for r in range(self.dp_size):
            s = self.stats[r]
            busy = (self.inflight[r] > 0 or self.last_sent[r] > self.last_heard[r]
                    or (s is not None and (s.num_running or s.num_waiting)))
            silent = now - self.last_heard[r]
            if busy and silent > timeout:
                out.append((r, silent))
        return out

    def fail_all(self, reason: str) -> None:
        """A rank died: end every sequence with a 503 error and refuse new ones."""
        self.dead_reason = reason
        for futures in self._control.values():
            for f in futures:
                if not f.done():
                    f.set_exception(RankFailed(reason))
        for rid, (st, queue) in list(self._seqs.items()):
            self._seqs.pop(rid, None)
            st.error_status = 503
            self._finish(st, "error", None, reason)
            queue.put_nowait((st, Delta("", [], [], True)))

    # --- outputs ---------------------------------------------------------------------------

    def on_messages(self, msgs: list[SchedulerOutput]) -> None:
        """What the ranks sent (the transport calls this on the event loop)."""
        for msg in msgs:
            if isinstance(msg, TokenOutput):
                self._on_output(msg)
            elif isinstance(msg, SchedulerStats):
                self.stats[msg.dp_rank] = msg
                self.last_heard[msg.dp_rank] = time.monotonic()
            elif isinstance(msg, RankMetrics):
                self.rank_metrics[(msg.dp_rank, msg.tp_rank)] = msg
            elif isinstance(msg, ControlResult):
                futures = self._control.get(msg.req_id)
                if futures is not None and not futures[msg.dp_rank].done():
                    futures[msg.dp_rank].set_result(msg)
            elif isinstance(msg, SchedulerReady):
                self.ready[msg.dp_rank] = msg
                self._ready_changed.set()
            elif isinstance(msg, SchedulerError):
                if not all(self.ready):
                    self._start_failure = f"DP rank {msg.dp_rank} failed to start: {msg.message}"
                    self._ready_changed.set()
                    continue
                logger.error("DP rank %d failed: %s", msg.dp_rank, msg.message)
                self.fail_all(f"DP rank {msg.dp_rank} failed: {msg.message}")

    def _on_output(self, o: TokenOutput) -> None:
        entry = self._seqs.get(o.rid)
        if entry is None:  # aborted here already
            return
        st, queue = entry
        now = time.monotonic()
        new = o.new_token_ids
        if new:
            if st.first_token_time is None:
                st.first_token_time = now
                self.metrics.ttft.observe(now - st.created)
            elif st.last_token_time is not None:
                self.metrics.tpot.observe((now - st.last_token_time) / len(new))
            st.last_token_time = now
            st.output_ids.extend(new)
        st.prompt_tokens = o.prompt_tokens
        st.completion_tokens = o.completion_tokens
        st.cached_tokens = o.cached_tokens
        if o.spec_verify_ct is not None:
            st.spec_verify_ct, st.spec_draft_token_num, st.spec_accept_token_num = (
                o.spec_verify_ct, o.spec_draft_token_num or 0, o.spec_accept_token_num or 0)
        if o.input_logprobs:
            st.input_logprobs = list(o.input_logprobs)
        lps: list[TokenLogprob] = []
        if o.new_logprobs:
            tops = o.new_top_logprobs or [[] for _ in o.new_logprobs]
            lps = [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in zip(new, o.new_logprobs, tops)]
            st.logprobs.extend(lps)
        trace = self._traces.get(o.rid) if self._traces else None
        if trace is not None and o.stages is not None:  # a traced sequence's final output
            trace.stages = o.stages
        t0 = time.perf_counter() if trace is not None else 0.0
        text = st.detok.feed(new) if new else ""
        if o.finished:
            matched = o.matched_stop if isinstance(o.matched_stop, str) and not st.spec.no_stop_trim else None
            text += st.detok.finish(matched)
        if trace is not None:
            trace.detokenize_s += time.perf_counter() - t0
            trace.num_outputs += 1
        if o.finished:
            self._seqs.pop(o.rid, None)
            if o.error:
                st.error_status = o.error_status
            self._finish(st, o.finish_reason or "stop", o.matched_stop, o.error)
        st.text = st.detok.text
        queue.put_nowait((st, Delta(text, list(new), lps, o.finished)))

    def _finish(self, st: SeqState, reason: str, matched, error: str | None) -> None:
        if st.finished:
            return
        st.finish_reason = reason
        st.matched_stop = matched
        st.error = error
        st.finished_time = time.monotonic()
        if st.spec.bootstrap is not None and self._rooms.get(st.spec.bootstrap.room) == st.rid:
            del self._rooms[st.spec.bootstrap.room]
        if st.dp_rank is not None:
            self.inflight[st.dp_rank] -= 1
        self.metrics.on_finish(reason, st.prompt_tokens, st.completion_tokens, st.cached_tokens, st.e2e_latency())
        trace = self._traces.pop(st.rid, None) if self.tracer is not None else None
        if trace is not None:
            record_sequence(self.tracer, st, trace, self.config.disaggregation_mode)


class RequestHandle:
    """The sequences of one HTTP request in flight: iterate for ``(state, delta)``; ``close()``
    aborts what has not finished (call it in ``finally``: a disconnected client cancels its handler)."""

    def __init__(self, manager: TokenizerManager, states: list[SeqState]):
        self.manager = manager
        self.states = states
        self.queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(states)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[SeqState, Delta]:
        if self._remaining == 0:
            raise StopAsyncIteration
        st, delta = await self.queue.get()
        if delta.finished:
            self._remaining -= 1
        return st, delta

    def drain_nowait(self) -> list[tuple[SeqState, Delta]]:
        """Updates already queued, without waiting (to coalesce writes)."""
        out = []
        while self._remaining and not self.queue.empty():
            st, delta = self.queue.get_nowait()
            if delta.finished:
                self._remaining -= 1
            out.append((st, delta))
        return out

    async def wait_all(self) -> list[SeqState]:
        async for _ in self:
            pass
        return sorted(self.states, key=lambda s: s.spec.index)

    def close(self) -> None:
        for st in self.states:
            if not st.finished:
                self.manager._abort_state(st, "client disconnected")
