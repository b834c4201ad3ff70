"""Offline API: the engine server's request path in this process, without HTTP.

    from pdserve.engine import Engine
    with Engine() as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

A call is an in-process ``/generate`` request: its arguments become a
``GenerateRequest`` that ``protocol.generate_sequences`` validates and expands,
and the sequences run through the server's own ``TokenizerManager``
(tokenization, text, stop trimming, logprobs). Its one scheduler rank is a
``LocalRank``: the scheduler processes' loop on a thread of this process
instead of a process behind ZMQ. Bad arguments raise ``ValueError`` (a
``RequestError``) naming the parameter before anything runs. A batch of
prompts is submitted at once, so it is scheduled together.

Threads: the caller's; the front end's event loop, where the tokenizer manager
lives; the rank's. ``generate`` and ``async_generate`` are one implementation
(``_submit`` and ``_Run``, coroutines on the front end's loop); they differ
only in how the caller waits for those.

Results (SGLang's /generate objects)::

    {"text": str, "output_ids": [int], "meta_info": {"id", "prompt_tokens",
     "completion_tokens", "cached_tokens", "e2e_latency", "dp_rank",
     "finish_reason": {"type", "matched"?, "message"?},
     "output_token_logprobs"?: [[logprob, token_id, None]],
     "output_top_logprobs"?: [[[logprob, token_id, None]]],
     "input_token_logprobs"?: [[logprob, token_id, None]]}}

With ``stream=True`` each chunk carries the *new* text, token ids and logprobs
since the previous chunk of its sequence (and ``index`` in a batch); the last
chunk of a sequence has ``meta_info["finish_reason"]`` set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, AsyncIterator, Callable, Coroutine, Iterator

import uvloop

from pdserve.engine.config import EngineConfig
from pdserve.engine.frontend import openai_api as api
from pdserve.engine.frontend.local_rank import STOP_JOIN_TIMEOUT, LocalRank
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.protocol import GenerateRequest, convert_body, generate_sequences
from pdserve.engine.frontend.tokenizer_manager import RequestHandle, TokenizerManager
from pdserve.engine.sched.scheduler_loop import SchedulerLoop
from pdserve.engine.server_config import ServerConfig

ALIVE_CHECK_S = 0.5  # how often a blocked caller checks that the engine still runs
SHUTDOWN = "engine is shut down"


class _Run:
    """One call's sequences in flight; its methods run on the front end's loop."""

    def __init__(self, tm: TokenizerManager, handle: RequestHandle, is_batch: bool):
        self.tm = tm
        self.handle = handle
        self.is_batch = is_batch

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
        return api.generate_object(st, delta=delta, length_detail=False)

    def close(self) -> None:
        """Abort what has not finished (a caller that stops reading a stream)."""
        self.handle.close()


class Engine:
    def __init__(self, model_path: str | None = None, dtype: str = "auto", **config):
        unknown = sorted(set(config) - EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown Engine argument {unknown[0]!r} (not an EngineConfig field)")
        if model_path is not None and not os.path.exists(model_path):
            raise ValueError(f"model_path {model_path!r} does not exist")
        self.config = EngineConfig(model_path=model_path, dtype=dtype, **config)
        self.loop = SchedulerLoop(self.config)
        self.tokenizer = self.loop.tokenizer
        self.arch = self.loop.arch
        self._closed = False
        self._rank = LocalRank(self.loop)
        self._tm: TokenizerManager | None = None
        self._front = uvloop.new_event_loop()
        self._front_thread = threading.Thread(target=self._front.run_forever, name="pdserve-engine-front", daemon=True)
        self._front_thread.start()
        try:
            self._tm = self._wait(self._open(ServerConfig(engine=self.config)))
        except BaseException:
            self.shutdown()
            raise
        self._limits = self._tm.limits()

    async def _open(self, server_config: ServerConfig) -> TokenizerManager:
        metrics = ServerMetrics(server_config.dp_size, server_config.model_name)
        tm = TokenizerManager(server_config, self.tokenizer, metrics, self._rank)
        await tm.wait_ready(server_config.startup_timeout, self._rank.is_alive)
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
    def _sequences(
        self, prompt, sampling_params, input_ids, rid, return_logprob, top_logprobs_num, logprob_start_len
    ):
        body = {
            "text": prompt,
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "rid": rid,
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num,
            "logprob_start_len": logprob_start_len,
        }
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
        rid: str | list[str] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> dict | list[dict] | Iterator[dict]:
        """One result for one prompt, a list for a batch (or ``n`` > 1); an iterator of chunks with
        ``stream=True``. Raises ``ValueError`` naming a bad parameter."""
        seqs, is_batch = self._sequences(
            prompt, sampling_params, input_ids, rid, return_logprob, top_logprobs_num, logprob_start_len
        )
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
        rid: str | list[str] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As ``generate``; with ``stream=True`` it returns an async iterator (``await`` it, then ``async for``)."""
        seqs, is_batch = self._sequences(
            prompt, sampling_params, input_ids, rid, return_logprob, top_logprobs_num, logprob_start_len
        )
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

    # -------------------------------------------------------------------- state
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the scheduler loop's thread between steps, after every request and abort
        sent before, and return its result (to look inside ``self.loop``)."""
        future = self._rank.call(fn)
        while not concurrent.futures.wait([future], ALIVE_CHECK_S).done:
            if self._closed:
                raise RuntimeError(SHUTDOWN)
            if not self._rank.is_alive():
                raise RuntimeError("engine loop died")
        return future.result()

    def stats(self):
        return self.call(self.loop.stats)

    def check_integrity(self) -> None:
        """Prove the page pool's bookkeeping."""
        self.call(self.loop.check_integrity)

    def flush_cache(self) -> bool:
        return self.call(self.loop.flush_cache)

    def shutdown(self) -> None:
        if self._closed:
            return
        if self._tm is not None and self._front_thread.is_alive():
            self._wait(self._fail_all())
        self._closed = True
        self._rank.close()
        self._front.call_soon_threadsafe(self._front.stop)
        self._front_thread.join(STOP_JOIN_TIMEOUT)
        if not self._front_thread.is_alive():
            self._front.close()

    async def _fail_all(self) -> None:
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
