"""Offline API: an in-process engine whose scheduler loop runs in a background thread.

    from pdserve.engine import Engine
    with Engine() as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

Each call tokenizes and validates in the caller's thread (bad parameters raise
``ValueError`` naming the parameter), then hands tokenized requests to the loop
thread through a queue. A batch of prompts is submitted at once, so it is
scheduled together. Results (SGLang's shape)::

    {"text": str, "output_ids": [int], "meta_info": {"id", "prompt_tokens",
     "completion_tokens", "cached_tokens", "finish_reason": {"type", "matched"?},
     "output_token_logprobs"?: [(logprob, token_id, None)],
     "output_top_logprobs"?: [[(logprob, token_id, None)]]}}

With ``stream=True`` each chunk carries the *new* text and token ids since the
previous chunk; the last chunk has ``meta_info["finish_reason"]`` set.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.frontend.detokenizer import Detokenizer
from pdserve.engine.messages import TokenizedGenerateReq, TokenOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler_loop import SchedulerLoop


class _Waiter:
    """Receives one request's outputs from the loop thread, for a sync or an asyncio consumer."""

    def __init__(self, aio_loop: asyncio.AbstractEventLoop | None = None):
        self.aio_loop = aio_loop
        self.q: queue.SimpleQueue | asyncio.Queue = asyncio.Queue() if aio_loop else queue.SimpleQueue()

    def put(self, item: TokenOutput | BaseException) -> None:
        if self.aio_loop is None:
            self.q.put(item)
        else:
            self.aio_loop.call_soon_threadsafe(self.q.put_nowait, item)


class _Result:
    """Folds one request's TokenOutputs into text, ids and meta_info."""

    def __init__(self, rid: str, sp: SamplingParams, tokenizer, return_logprob: bool, input_ids: list[int]):
        self.rid = rid
        self.sp = sp
        self.detok = Detokenizer(tokenizer, sp.stop, sp.skip_special_tokens)
        self.return_logprob = return_logprob
        self.output_ids: list[int] = []
        self.logprobs: list[tuple[float, int, None]] = []
        self.top_logprobs: list[list[tuple[float, int, None]]] = []
        self.input_logprobs: list[tuple[float | None, int, None]] = []
        self.input_ids = input_ids
        self.meta: dict[str, Any] = {"id": rid, "finish_reason": None}

    def add(self, out: TokenOutput) -> dict[str, Any]:
        """Fold in one output; return the incremental chunk."""
        text = self.detok.feed(out.new_token_ids)
        if out.finished:
            text += self.detok.finish(out.matched_stop if isinstance(out.matched_stop, str) else None)
            reason: dict[str, Any] = {"type": out.finish_reason}
            if out.matched_stop is not None:
                reason["matched"] = out.matched_stop
            if out.error:
                reason["message"] = out.error
            self.meta["finish_reason"] = reason
        self.output_ids.extend(out.new_token_ids)
        self.meta.update(
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens
        )
        chunk_meta = dict(self.meta)
        if self.return_logprob:
            new_lp = [(lp, t, None) for lp, t in zip(out.new_logprobs, out.new_token_ids)]
            new_top = [[(lp, t, None) for t, lp in top] for top in out.new_top_logprobs]
            self.logprobs.extend(new_lp)
            self.top_logprobs.extend(new_top)
            chunk_meta.update(output_token_logprobs=new_lp, output_top_logprobs=new_top)
            if out.input_logprobs:
                ids = self.input_ids[len(self.input_ids) - len(out.input_logprobs) :]
                self.input_logprobs = [(lp, t, None) for lp, t in zip(out.input_logprobs, ids)]
                chunk_meta["input_token_logprobs"] = self.input_logprobs
        return {"text": text, "output_ids": list(out.new_token_ids), "meta_info": chunk_meta}

    def final(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.return_logprob:
            meta.update(output_token_logprobs=self.logprobs, output_top_logprobs=self.top_logprobs)
            if self.input_logprobs:
                meta["input_token_logprobs"] = self.input_logprobs
        return {"text": self.detok.text, "output_ids": self.output_ids, "meta_info": meta}


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
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ loop thread
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                block = not self.loop.has_work()
                self._drain_inbox(block)
                if self.loop.has_work():
                    for out in self.loop.step():
                        self._deliver(out)
        except BaseException as exc:  # the loop is dead: every waiter must hear it
            self._error = exc
            with self._lock:
                waiters, self._waiters = list(self._waiters.values()), {}
            for w in waiters:
                w.put(exc)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = item
            if kind == "add":
                self.loop.add_request(arg)
            elif kind == "abort":
                self.loop.abort(arg)
            elif kind == "call":
                fn, box, done = arg
                try:
                    box.append(fn())
                except BaseException as exc:
                    box.append(exc)
                done.set()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: TokenOutput) -> None:
        with self._lock:
            w = self._waiters.pop(out.rid, None) if out.finished else self._waiters.get(out.rid)
        if w is not None:
            w.put(out)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result."""
        self._check_alive()
        box: list = []
        done = threading.Event()
        self._inbox.put(("call", (fn, box, done)))
        while not done.wait(0.1):
            self._check_alive()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}") from self._error
        if self._stopped.is_set():
            raise RuntimeError("engine is shut down")

    # ------------------------------------------------------------- validation
    def _prepare(
        self, prompt, sampling_params, input_ids, stream, rid, return_logprob, top_logprobs_num, logprob_start_len=-1
    ) -> tuple[list[TokenizedGenerateReq], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not prompts or any(not isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a str or a non-empty list of str")
            if any(p == "" for p in prompts):
                raise ValueError("prompt is empty")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
            name = "prompt"
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            if not ids_list:
                raise ValueError("input_ids is empty")
            name = "input_ids"
        n = len(ids_list)
        if sampling_params is None or isinstance(sampling_params, dict):
            sp_list = [sampling_params or {}] * n
        else:
            sp_list = list(sampling_params)
            if len(sp_list) != n:
                raise ValueError(f"sampling_params has {len(sp_list)} entries for {n} prompts")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        else:
            rids = [rid] if isinstance(rid, str) else list(rid)
            if len(rids) != n or len(set(rids)) != n:
                raise ValueError(f"rid must name each of the {n} prompts once")
        if top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        ctx = self.arch.max_context_len
        capacity = self.loop.pool.max_total_tokens
        reqs = []
        for ids, spd, r in zip(ids_list, sp_list, rids):
            if not ids:
                raise ValueError(f"{name} is empty")
            if any(not isinstance(t, int) or not 0 <= t < self.arch.vocab_size for t in ids):
                raise ValueError(f"input_ids has a token outside the vocabulary [0, {self.arch.vocab_size})")
            if len(ids) > ctx:
                raise ValueError(f"{name} has {len(ids)} tokens, longer than the model's context of {ctx}")
            if len(ids) > capacity:
                raise ValueError(f"{name} has {len(ids)} tokens, more than the KV pool holds ({capacity})")
            sp = _to_sampling_params(spd)
            sp.validate(self.arch.vocab_size)
            room = ctx - len(ids)
            if sp.max_new_tokens > room:  # as SGLang: generation stops at the context's end
                sp = msgspec.structs.replace(sp, max_new_tokens=room, min_new_tokens=min(sp.min_new_tokens, room))
            # n > 1: n independent requests for the prompt (results in order), as SGLang's Engine does
            copies = [(r, sp)] if sp.n == 1 else [
                (f"{r}-{j}", msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j))
                for j in range(sp.n)
            ]
            if sp.n > 1:
                single = False
            for cr, csp in copies:
                reqs.append(
                    TokenizedGenerateReq(
                        rid=cr,
                        input_ids=ids,
                        sampling_params=csp,
                        stream=stream,
                        return_logprob=return_logprob,
                        top_logprobs_num=top_logprobs_num,
                        logprob_start_len=logprob_start_len,
                    )
                )
        return reqs, single

    def _submit(self, reqs: list[TokenizedGenerateReq], make_waiter=None) -> list[tuple[_Waiter, _Result]]:
        self._check_alive()
        make_waiter = make_waiter or (lambda i: _Waiter())
        pairs = []
        with self._lock:
            for r in reqs:
                if r.rid in self._waiters:
                    raise ValueError(f"rid {r.rid!r} is already in flight")
            for i, r in enumerate(reqs):
                w = make_waiter(i)
                self._waiters[r.rid] = w
                pairs.append((w, _Result(r.rid, r.sampling_params, self.tokenizer, r.return_logprob, r.input_ids)))
        for r in reqs:
            self._inbox.put(("add", r))
        return pairs

    # ------------------------------------------------------------------ API
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
        reqs, single = self._prepare(
            prompt, sampling_params, input_ids, stream, rid, return_logprob, top_logprobs_num, logprob_start_len
        )
        if stream:
            merged: queue.SimpleQueue = queue.SimpleQueue()
            pairs = self._submit(reqs, lambda i: _Tagged(merged, i))
            return self._stream(pairs, merged, single)
        pairs = self._submit(reqs)
        results = []
        for w, res in pairs:
            while True:
                out = self._get(w)
                res.add(out)
                if out.finished:
                    break
            results.append(res.final())
        return results[0] if single else results

    def _get(self, w: _Waiter) -> TokenOutput:
        while True:
            try:
                item = w.q.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(item, BaseException):
                raise RuntimeError(f"engine loop died: {item!r}") from item
            return item

    def _stream(self, pairs, merged: queue.SimpleQueue, single: bool) -> Iterator[dict]:
        # chunks of all the batch's requests as they come; each carries its prompt's index
        remaining = len(pairs)
        try:
            while remaining:
                try:
                    i, item = merged.get(timeout=0.5)
                except queue.Empty:
                    self._check_alive()
                    continue
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine loop died: {item!r}") from item
                chunk = pairs[i][1].add(item)
                if item.finished:
                    remaining -= 1
                if not single:
                    chunk["index"] = i
                yield chunk
        finally:
            if remaining:  # the caller stopped reading: end what is left
                for w, res in pairs:
                    if res.meta["finish_reason"] is None:
                        self.abort(res.rid)

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
        reqs, single = self._prepare(
            prompt, sampling_params, input_ids, stream, rid, return_logprob, top_logprobs_num, logprob_start_len
        )
        aio_loop = asyncio.get_running_loop()
        pairs = self._submit(reqs, lambda i: _Waiter(aio_loop))
        if stream:
            return self._astream(pairs, single)
        results = []
        for w, res in pairs:
            while True:
                out = await self._aget(w)
                res.add(out)
                if out.finished:
                    break
            results.append(res.final())
        return results[0] if single else results

    async def _aget(self, w: _Waiter) -> TokenOutput:
        while True:
            try:
                item = await asyncio.wait_for(w.q.get(), timeout=0.5)
            except asyncio.TimeoutError:
                self._check_alive()
                continue
            if isinstance(item, BaseException):
                raise RuntimeError(f"engine loop died: {item!r}") from item
            return item

    async def _astream(self, pairs, single: bool) -> AsyncIterator[dict]:
        tasks = {asyncio.ensure_future(self._aget(w)): i for i, (w, _) in enumerate(pairs)}
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    i = tasks.pop(t)
                    out = t.result()
                    chunk = pairs[i][1].add(out)
                    if not out.finished:
                        tasks[asyncio.ensure_future(self._aget(pairs[i][0]))] = i
                    if not single:
                        chunk["index"] = i
                    yield chunk
        finally:
            for t in tasks:
                t.cancel()
            for _, res in pairs:
                if res.meta["finish_reason"] is None:
                    self.abort(res.rid)

    def abort(self, rid: str) -> None:
        """End request ``rid`` (its pages are freed); its caller gets finish_reason ``abort``."""
        if not self._stopped.is_set():
            self._inbox.put(("abort", rid))

    # -------------------------------------------------------------- state
    def stats(self):
        return self._call(self.loop.stats)

    def check_integrity(self) -> None:
        """Prove the page pool's bookkeeping (run between steps on the loop thread)."""
        self._call(self.loop.check_integrity)

    def flush_cache(self) -> bool:
        return self._call(self.loop.flush_cache)

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


class _Tagged:
    """A waiter queue that forwards into a shared queue, tagged with the request's index."""

    def __init__(self, merged: queue.SimpleQueue, index: int):
        self.merged = merged
        self.index = index

    def put(self, item) -> None:
        self.merged.put((self.index, item))


def _to_sampling_params(d: dict | SamplingParams) -> SamplingParams:
    if isinstance(d, SamplingParams):
        return d
    if not isinstance(d, dict):
        raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
    d = dict(d)
    if isinstance(d.get("stop"), str):  # SGLang accepts one stop string as a plain str
        d["stop"] = [d["stop"]]
    unknown = sorted(set(d) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise ValueError(f"sampling_params has unknown field {unknown[0]!r}")
    try:
        return msgspec.convert(d, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling_params: {exc}") from exc
