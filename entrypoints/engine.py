"""Offline API: the engine server's request path in this process, without HTTP (SGLang's ``Engine``).

    from pdserve.engine import Engine
    with Engine() as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

``Engine(**flags)`` takes the ``pdserve serve`` flags as keyword arguments
(``ServerConfig.from_flags``: SGLang's names, e.g. ``disaggregation_mode``,
``disaggregation_bootstrap_port``, ``disaggregation_transfer_backend``,
``dp_size``, ``tp_size``, ``max_total_tokens``); an unknown one raises
``ValueError``. ``disaggregation_mode="prefill"`` starts the bootstrap server
on ``disaggregation_bootstrap_port`` and the prefill rank's KV manager;
``"decode"`` the decode rank's; two Engines (in one program or two) then form a
PD pair: give both legs of a request the same ``bootstrap_host``,
``bootstrap_port`` (the prefill Engine's) and ``bootstrap_room``, and read the
answer from the decode Engine, as SGLang's router does.

A call is an in-process ``/generate`` request: its keyword arguments are the
``/generate`` body's fields (``GenerateRequest``: ``rid``, ``return_logprob``,
``top_logprobs_num``, ``logprob_start_len``, ``bootstrap_host``,
``bootstrap_port``, ``bootstrap_room`` (one per prompt, or a list for a batch),
``routed_dp_rank``, ``disagg_prefill_dp_rank``), validated by
``sequences.generate_sequences``, and the sequences run through the server's
own ``TokenizerManager``. The scheduler ranks are processes started as
``pdserve serve`` starts them (``serve.spawn_ranks``, spawned: a script that
makes an Engine needs an ``if __name__ == "__main__":`` guard), as SGLang's
Engine does; a dead one fails what is in flight with its name. So the steps run
at a fresh process's speed whatever this process did before: a rank on a
thread of a process whose main thread had run torch shares the process with a
second OpenMP pool, and with more OpenMP threads than cores libgomp throttles
its barrier spinning (docs/ENGINE.md). ``Engine(rank_on_thread=True)`` (``dp_size = tp_size = 1``)
runs the one rank as a ``LocalRank`` on a thread of this process instead (the
same loop, built by the same loop builders, ``entrypoints/loops.py``): it starts faster, and
``call``, ``loop``, ``stats`` and ``check_integrity`` look inside it; use it in
a process that has not run torch on another thread. Bad arguments raise ``ValueError`` (a
``RequestError``) naming the parameter before anything runs. A batch of
prompts is submitted at once, so it is scheduled together.

Control operations are SGLang's (``get_server_info``, ``flush_cache``,
``update_weights_from_disk``, ``get_weights_by_name``,
``release_memory_occupation``/``resume_memory_occupation``,
``start_profile``/``stop_profile``): typed messages to the rank, the same path
as the HTTP endpoints (``control_api``).

Threads: the caller's; the front end's event loop, where the tokenizer manager
(and a prefill Engine's bootstrap server) lives; the in-process rank's. ``generate`` and
``async_generate`` are one implementation (``_submit`` and ``_Run``, coroutines
on the front end's loop); they differ only in how the caller waits for those.

Results (SGLang's /generate objects)::

    {"text": str, "output_ids": [int], "meta_info": {"id", "prompt_tokens",
     "completion_tokens", "cached_tokens", "e2e_latency", "dp_rank",
     "finish_reason": {"type", "matched"?, "message"?},
     "output_token_logprobs"?: [[logprob, token_id, None]],
     "output_top_logprobs"?: [[[logprob, token_id, None]]],
     "input_token_logprobs"?: [[logprob, token_id, None]]}}

Streaming, as SGLang's Engine: with ``stream=True`` each chunk is such an
object for one sequence (with ``index`` in a batch) holding everything so far:
the *whole* text, all output ids and logprobs (SGLang's default,
``incremental_streaming_output=False``; a chunk's new text is what its text
adds to the previous chunk's). ``Engine(incremental_streaming_output=True)``
makes each chunk carry only what is new since the previous chunk of its
sequence. The last chunk of a sequence has ``meta_info["finish_reason"]`` set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, AsyncIterator, Callable, Coroutine, Iterator

import uvloop

from pdserve.engine.frontend import control_api
from pdserve.engine.frontend import openai_api as api
from pdserve.engine.frontend.local_rank import STOP_JOIN_TIMEOUT, LocalRank
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.request_error import convert_body
from pdserve.engine.frontend.request_schemas import GenerateRequest
from pdserve.engine.frontend.sequences import generate_sequences
from pdserve.engine.frontend.rank_transport import ZmqTransport
from pdserve.engine.frontend.tokenizer_manager import RequestHandle, TokenizerManager
from pdserve.entrypoints.loops import rank_loop_builder
from pdserve.entrypoints.serve import check_model, spawn_ranks, start_bootstrap_server, stop_ranks, watch_ranks
from pdserve.engine.server_config import ServerConfig

ALIVE_CHECK_S = 0.5  # how often a blocked caller checks that the engine still runs
SHUTDOWN = "engine is shut down"


class _Run:
    """One call's sequences in flight; its methods run on the front end's loop."""

    def __init__(self, tm: TokenizerManager, handle: RequestHandle, is_batch: bool):
        self.tm = tm
        self.handle = handle
        self.is_batch = is_batch
        self.incremental = tm.config.incremental_streaming_output

    def _check_alive(self) -> None:
        if self.tm.dead_reason is not None:  # every sequence in flight ended with this error
            raise RuntimeError(self.tm.dead_reason)

    async def result(self) -> dict | list[dict]:
        try:
            states = await self.handle.wait_all()
        finally:
            self.handle.close()
        self._check_alive()
        outs = [api.generate_object(st, length_detail=False) for st in states]
        return outs if self.is_batch else outs[0]

    async def next_chunk(self) -> dict | None:
        """The next stream chunk of any of the call's sequences; None after the last."""
        try:
            st, delta = await self.handle.__anext__()
        except StopAsyncIteration:
            return None
        self._check_alive()
        return api.generate_object(st, delta=delta if self.incremental else None, length_detail=False)

    def close(self) -> None:
        """Abort what has not finished (a caller that stops reading a stream)."""
        self.handle.close()


class Engine:
    def __init__(self, model_path: str | None = None, dtype: str = "auto", rank_on_thread: bool = False, **flags):
        """``flags``: ``pdserve serve``'s flags by field name; ``rank_on_thread``: the one rank on a
        thread of this process rather than its own process (see the module's docstring)."""
        if model_path is not None and not os.path.exists(model_path):
            raise ValueError(f"model_path {model_path!r} does not exist")
        try:
            server_config = ServerConfig.from_flags({"model_path": model_path, "dtype": dtype, **flags})
        except TypeError as e:  # a flag of the wrong kind
            raise ValueError(str(e)) from None
        if rank_on_thread and (server_config.dp_size, server_config.tp_size) != (1, 1):
            raise ValueError("rank_on_thread runs one rank: it needs dp_size = tp_size = 1")
        self.rank_on_thread = rank_on_thread
        self.server_config = server_config
        self.config = server_config.engine
        self._procs: dict = {}  # scheduler processes, with dp_size or tp_size > 1
        self._watch: asyncio.Future | None = None
        if self.config.speculative_draft_model_path is not None:  # refused naming the flag, before weights load
            check_model(server_config)
        if self.in_process:
            build = rank_loop_builder(server_config.disaggregation_mode)
            self._rank: LocalRank | None = LocalRank(lambda: build(server_config, LocalRank.DP_RANK, 0))
            self.loop = self._rank.loop
            self.tokenizer = self.loop.tokenizer
            self.arch = self.loop.arch
        else:
            from pdserve.engine.model_executor.model_loader import load_arch
            from pdserve.engine.text.tokenizer import load_tokenizer

            self.loop = None
            self.arch = load_arch(self.config.model_path)
            # the heads split within an attention group, the MLP over every rank
            self.arch.check_parallel(server_config.attn_tp_size, server_config.tp_size)
            self.tokenizer = load_tokenizer(self.config.model_path)
            self._rank = None
        self._closed = False
        self._tm: TokenizerManager | None = None
        self._bootstrap = None
        self._front = uvloop.new_event_loop()
        self._front_thread = threading.Thread(target=self._front.run_forever, name="pdserve-engine-front", daemon=True)
        self._front_thread.start()
        try:
            self._tm = self._wait(self._open(server_config))
        except BaseException:
            self.shutdown()
            raise
        self._limits = self._tm.limits()

    @property
    def in_process(self) -> bool:
        """One scheduler rank on a thread of this process (``rank_on_thread``); else scheduler
        processes, one per DP and TP rank, as ``pdserve serve`` starts them."""
        return self.rank_on_thread

    async def _open(self, server_config: ServerConfig) -> TokenizerManager:
        metrics = ServerMetrics(server_config.dp_size, server_config.model_name, server_config.enable_dp_attention)
        self._bootstrap = await start_bootstrap_server(server_config, metrics)
        if self.in_process:
            tm = TokenizerManager(server_config, self.tokenizer, metrics, self._rank)
            await tm.wait_ready(server_config.startup_timeout, self._rank.is_alive)
            return tm
        # spawned from the front end's thread: the ranks die with it (PR_SET_PDEATHSIG follows the
        # thread that started them), which lives until shutdown
        transport = ZmqTransport(server_config.dp_size)
        tm = TokenizerManager(server_config, self.tokenizer, metrics, transport)
        self._procs = spawn_ranks(server_config, transport)
        await tm.wait_ready(server_config.startup_timeout, lambda: all(p.is_alive() for p in self._procs.values()))
        self._watch = asyncio.ensure_future(watch_ranks(server_config, self._procs, tm))
        return tm

    # ------------------------------------------------------- the front end's loop
    def _wait(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the front end's loop and block this thread for its result."""
        if self._closed:
            coro.close()
            raise RuntimeError(SHUTDOWN)
        future = asyncio.run_coroutine_threadsafe(coro, self._front)
        while not concurrent.futures.wait([future], ALIVE_CHECK_S).done:
            if not self._front_thread.is_alive():
                raise RuntimeError(SHUTDOWN)
        return future.result()

    async def _await(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the front end's loop and await its result on the caller's loop."""
        if self._closed:
            coro.close()
            raise RuntimeError(SHUTDOWN)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._front))

    def _post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the front end's loop, without waiting."""
        if not self._closed:
            self._front.call_soon_threadsafe(fn)

    # ----------------------------------------------------------------- requests
    def _sequences(self, prompt, sampling_params, input_ids, request: dict):
        for name in ("text", "stream"):
            if name in request:
                raise ValueError(f"{name!r} is not an argument of generate (the prompt is 'prompt'; see 'stream')")
        body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params, **request}
        return generate_sequences(convert_body(body, GenerateRequest), self._limits, text_param="prompt")

    async def _submit(self, seqs, is_batch: bool) -> _Run:
        if self._tm.dead_reason is not None:
            raise RuntimeError(self._tm.dead_reason)
        return _Run(self._tm, self._tm.submit(seqs, batch=is_batch), is_batch)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **request,
    ) -> dict | list[dict] | Iterator[dict]:
        """One result for one prompt, a list for a batch (or ``n`` > 1); an iterator of chunks with
        ``stream=True`` (see the module's docstring for what a chunk holds). ``request``: the other
        fields of SGLang's ``/generate`` body (``rid``, ``return_logprob``, ``top_logprobs_num``,
        ``logprob_start_len``, ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``,
        ``routed_dp_rank``, ``disagg_prefill_dp_rank``, ...). Raises ``ValueError`` naming a bad one."""
        seqs, is_batch = self._sequences(prompt, sampling_params, input_ids, request)
        run = self._wait(self._submit(seqs, is_batch))
        if stream:
            return self._stream(run)
        return self._wait(run.result())

    def _stream(self, run: _Run) -> Iterator[dict]:
        try:
            while (chunk := self._wait(run.next_chunk())) is not None:
                yield chunk
        finally:
            self._post(run.close)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **request,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As ``generate``; with ``stream=True`` it returns an async iterator (``await`` it, then ``async for``)."""
        seqs, is_batch = self._sequences(prompt, sampling_params, input_ids, request)
        run = await self._await(self._submit(seqs, is_batch))
        if stream:
            return self._astream(run)
        return await self._await(run.result())

    async def _astream(self, run: _Run) -> AsyncIterator[dict]:
        try:
            while (chunk := await self._await(run.next_chunk())) is not None:
                yield chunk
        finally:
            self._post(run.close)

    def abort(self, rid: str) -> None:
        """End request ``rid`` (its pages are freed); its caller gets finish_reason ``abort``.
        Returns once the abort is on its way to the rank, so a ``call`` after it sees it done."""
        if not self._closed:
            self._wait(self._abort(rid))

    async def _abort(self, rid: str) -> None:
        self._tm.abort(rid, "aborted by Engine.abort")

    # ------------------------------------------------------- control operations
    def get_server_info(self) -> dict:
        """What ``/get_server_info`` answers: the flags and each rank's state."""
        return self._wait(self._server_info())

    async def _server_info(self) -> dict:
        return control_api.server_info(self._tm)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; False (nothing done) while requests run or wait, as SGLang."""
        return self._wait(control_api.flush_cache(self._tm)).success

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False) -> tuple[bool, str]:
        """Load another checkpoint of the same architecture; returns ``(success, message)``.
        Requests in flight finish on the old weights (``abort_all_requests=True``: they are aborted
        first); calls made meanwhile wait and run on the new ones; the prefix cache is flushed."""
        inp = control_api.UpdateWeightsFromDiskInput(model_path=model_path, load_format=load_format,
                                                     abort_all_requests=abort_all_requests)
        answer = self._wait(control_api.update_weights_from_disk(self._tm, inp))
        return answer.success, answer.message

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of checkpoint weight ``name`` as the rank holds it
        (float32, nested lists); ValueError when there is no such weight."""
        inp = control_api.GetWeightsByNameInput(name=name, truncate_size=truncate_size)
        answer = self._wait(control_api.get_weights_by_name(self._tm, inp))
        if not answer.success:
            raise ValueError(answer.message)
        return answer.data

    def _checked(self, answer: control_api.ControlAnswer) -> str:
        if not answer.success:
            raise RuntimeError(answer.message)
        return answer.message

    def release_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Give the KV pool's memory (tag ``kv_cache``) and the weights' (``weights``) back to the OS;
        None: both. Only while idle (RuntimeError otherwise). Until resumed, a new request ends with an
        error naming what is released."""
        inp = control_api.MemoryOccupationInput(tags=tags)
        return self._checked(self._wait(control_api.release_memory_occupation(self._tm, inp)))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Restore what ``release_memory_occupation`` gave back (the weights are read from disk again)."""
        inp = control_api.MemoryOccupationInput(tags=tags)
        return self._checked(self._wait(control_api.resume_memory_occupation(self._tm, inp)))

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      record_shapes: bool = False, with_stack: bool = False) -> str:
        """torch.profiler over the rank's next steps (``num_steps``, or until ``stop_profile``); the
        Chrome trace goes to ``output_dir`` (default ``--profile-dir``, else the temp folder)."""
        inp = control_api.ProfileInput(output_dir=output_dir, num_steps=num_steps, record_shapes=record_shapes,
                                       with_stack=with_stack)
        return self._checked(self._wait(control_api.start_profile(self._tm, inp)))

    def stop_profile(self) -> str:
        """Stop the profile and write its trace; returns the message naming the file."""
        return self._checked(self._wait(control_api.stop_profile(self._tm)))

    def start_expert_distribution_record(self) -> str:
        """Zero the per-layer, per-expert token counts and count from the next step on."""
        return self._checked(self._wait(control_api.start_expert_distribution_record(self._tm)))

    def stop_expert_distribution_record(self) -> str:
        return self._checked(self._wait(control_api.stop_expert_distribution_record(self._tm)))

    def dump_expert_distribution_record(self) -> list[list[int]]:
        """The counts recorded since start, [num_layers][num_experts] summed over every rank (SGLang's
        ``logical_count``); the counts start again from zero."""
        answer = self._wait(control_api.dump_expert_distribution_record(self._tm))
        self._checked(answer)
        return answer.data

    # -------------------------------------------------------------------- state
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the scheduler loop's thread between steps, after every request and abort
        sent before, and return its result (to look inside ``self.loop``). In-process rank only."""
        if self._rank is None:
            raise RuntimeError("call() looks inside the in-process rank of Engine(rank_on_thread=True); "
                               "the ranks are processes otherwise (get_server_info reports their state)")
        future = self._rank.call(fn)
        while not concurrent.futures.wait([future], ALIVE_CHECK_S).done:
            if self._closed:
                raise RuntimeError(SHUTDOWN)
            if not self._rank.is_alive():
                raise RuntimeError("engine loop died")
        return future.result()

    def stats(self):
        return self.call(lambda: self.loop.stats())

    def check_integrity(self) -> None:
        """Prove the page pool's bookkeeping."""
        self.call(lambda: self.loop.check_integrity())

    def shutdown(self) -> None:
        if self._closed:
            return
        if self._tm is not None and self._front_thread.is_alive():
            self._wait(self._fail_all())
        self._closed = True
        if self._rank is not None:
            self._rank.close()
            self.loop.close()  # a PD loop closes its KV manager
        stop_ranks(list(self._procs.values()))
        if self._front_thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close_front(), self._front).result(STOP_JOIN_TIMEOUT)
        self._front.call_soon_threadsafe(self._front.stop)
        self._front_thread.join(STOP_JOIN_TIMEOUT)
        if not self._front_thread.is_alive():
            self._front.close()

    async def _close_front(self) -> None:
        if self._procs and self._tm is not None:
            self._tm.close()  # the ZMQ transport's sockets live on this loop
        if self._bootstrap is not None:
            await self._bootstrap.stop()

    async def _fail_all(self) -> None:
        if self._watch is not None:
            self._watch.cancel()  # the ranks are stopped next: no death to report
        self._tm.fail_all(SHUTDOWN)  # callers waiting on a sequence get RuntimeError
        await asyncio.sleep(0)  # let them take their last update before the loop stops

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
