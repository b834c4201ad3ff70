"""A stand-in SGLang/pdserve prefill or decode server, for router tests and benchmarks.

It speaks the server side of SGLang's PD protocol without a model: ``/health``,
``/get_server_info`` and ``/server_info`` (with ``dp_size``),
``/get_model_info`` and ``/model_info``, ``/v1/models``, and ``/generate``,
``/v1/completions``, ``/v1/chat/completions`` in JSON or SSE (ending with
``data: [DONE]``). A prefill stand-in answers with one token (the form asked
for), a decode stand-in with ``num_tokens`` tokens. ``Behavior`` knobs make it
fail, delay, hang or fail mid-stream; it records the bodies it got, and the
requests whose client went away before the answer was complete (``cancelled``),
which is how tests see that the router cancelled a leg.

Lives with the tests because it is test code, not a part of pdserve; it imports nothing
of pdserve, so ``scripts/bench_router.py`` runs it by path as its own process:
``python tests/support/standin_worker.py --role decode --port 8001``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from dataclasses import dataclass, field, fields

import msgspec
from aiohttp import web

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_JSON = "application/json"
# SGLang's control endpoints a router fans out (recorded like inference requests)
CONTROL_PATHS = ("/flush_cache", "/update_weights_from_disk", "/release_memory_occupation",
                 "/resume_memory_occupation", "/load_lora_adapter", "/unload_lora_adapter")


@dataclass
class Behavior:
    fail_status: int = 0  # answer inference requests with this HTTP status (0: answer normally)
    fail_times: int = -1  # how many inference requests fail while fail_status is set (-1: all)
    delay_s: float = 0.0  # wait before answering
    hang: bool = False  # never answer (until the client goes away)
    fail_midstream_after: int = -1  # streamed answers: drop the connection after N events
    health_status: int = 200
    num_tokens: int = 4  # tokens a decode stand-in generates (a prefill stand-in: 1)
    token_delay_s: float = 0.0  # between streamed events
    dp_size: int = 1
    model: str = "standin-model"
    record: bool = True  # keep the request bodies (off in benchmarks)
    control_status: int = 200  # the answer to the control endpoints (/flush_cache, ...)
    # a decode stand-in's /server_info max_local_prefill_tokens (pdserve's flag; 0: refuses local prefills)
    max_local_prefill_tokens: int = 1 << 20
    pad_bytes: int = 0  # JSON answers carry a "pad" string of this many bytes (large answers)
    # a decode stand-in's room per DP rank (its ``routed_dp_rank``), as a KV pool bounds a rank: the
    # tokens (prompt + max new tokens) its requests hold at once; one that does not fit waits,
    # first come first served, before its first byte (0: no bound)
    rank_token_budget: int = 0


@dataclass
class Record:
    path: str
    body: dict
    headers: dict = field(default_factory=dict)


class StandinWorker:
    def __init__(self, role: str, behavior: Behavior | None = None, host: str = "127.0.0.1",
                 port: int = 0):
        assert role in ("prefill", "decode")
        self.role = role
        self.behavior = behavior or Behavior()
        self.host, self.port = host, port
        self.requests: list[Record] = []
        self.cancelled: list[Record] = []  # client went away before the answer was complete
        self.completed = 0
        self.health_checks = 0
        self.last_answer = b""  # the body of the last JSON inference answer
        self.in_flight = 0
        self.rank_tokens: dict[int, int] = {}  # DP rank -> tokens its admitted requests hold (rank_token_budget)
        self._rank_queue: dict[int, collections.deque] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def rooms(self) -> list:
        return [r.body.get("bootstrap_room") for r in self.requests]

    def make_app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self._server_info)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self._model_info)
        r.add_get("/v1/models", self._models)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            r.add_post(path, self._infer)
        for path in CONTROL_PATHS:
            r.add_post(path, self._control)
        r.add_post("/_standin/behavior", self._set_behavior)
        r.add_get("/_standin/stats", self._stats)
        return app

    async def start(self) -> str:
        # handler_cancellation: a client disconnect cancels the handler, as in a real server
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port bound when asked for 0
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # info endpoints ------------------------------------------------------
    async def _health(self, request):
        self.health_checks += 1
        b = self.behavior
        if b.health_status != 200:
            return web.json_response({"status": "unhealthy"}, status=b.health_status)
        return web.Response(body=b"", status=200)

    async def _server_info(self, request):
        b = self.behavior
        info = {"dp_size": b.dp_size, "model_path": b.model, "tp_size": 1, "disaggregation_mode": self.role,
                "version": "standin"}
        if self.role == "decode":
            info["max_local_prefill_tokens"] = b.max_local_prefill_tokens
        return web.json_response(info)

    async def _model_info(self, request):
        b = self.behavior
        return web.json_response({"model_path": b.model, "tokenizer_path": None,
                                  "is_generation": True})

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.behavior.model, "object": "model", "created": 0, "owned_by": "pdserve"}]})

    async def _set_behavior(self, request):
        updates = await request.json()
        names = {f.name for f in fields(Behavior)}
        for k, v in updates.items():
            if k not in names:
                return web.json_response({"error": f"unknown knob {k}"}, status=400)
            setattr(self.behavior, k, v)
        return web.json_response({"ok": True})

    async def _stats(self, request):
        return web.json_response({"requests": len(self.requests), "cancelled": len(self.cancelled),
                                  "completed": self.completed, "in_flight": self.in_flight})

    async def _control(self, request):
        raw = await request.read()
        self.requests.append(Record(request.path, _decode(raw) if raw else {}, dict(request.headers)))
        ok = self.behavior.control_status == 200
        return web.json_response({"success": ok, "message": f"stand-in {self.role} {request.path}"},
                                 status=self.behavior.control_status)

    # inference -----------------------------------------------------------
    async def _infer(self, request: web.Request):
        b = self.behavior
        body = _decode(await request.read())
        rec = Record(request.path, body, dict(request.headers))
        if b.record:
            self.requests.append(rec)
        self.in_flight += 1
        try:
            if b.fail_status and b.fail_times != 0:
                if b.fail_times > 0:
                    b.fail_times -= 1
                return web.Response(body=_encode({"error": {
                    "message": f"stand-in {self.role} told to fail", "type": "server_error",
                    "param": None, "code": b.fail_status}}), status=b.fail_status, content_type=_JSON)
            if b.hang:
                await asyncio.sleep(3600)
            if b.delay_s:
                await asyncio.sleep(b.delay_s)
            n = 1 if self.role == "prefill" else max(1, _max_tokens(body, b.num_tokens))
            if self.role == "decode" and b.rank_token_budget:
                rank, need = body.get("routed_dp_rank") or 0, _prompt_len(body) + n
                await self._admit(rank, need)
                try:
                    if body.get("stream"):
                        return await self._stream(request, rec, body, n)
                    return self._json_answer(request.path, body, n)
                finally:
                    self._release(rank, need)
            if body.get("stream"):
                return await self._stream(request, rec, body, n)
            return self._json_answer(request.path, body, n)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(rec)
            raise
        finally:
            self.in_flight -= 1

    def _json_answer(self, path: str, body: dict, n: int) -> web.Response:
        b = self.behavior
        answer = _final(path, body, n, b.model, self.role)
        if b.pad_bytes:
            answer["pad"] = "".join(chr(97 + i % 26) for i in range(b.pad_bytes))
        self.last_answer = _encode(answer)
        self.completed += 1
        return web.Response(body=self.last_answer, content_type=_JSON)

    async def _admit(self, rank: int, need: int) -> None:
        """Wait until DP rank ``rank`` has room for ``need`` tokens (those before it first); the
        caller releases them with ``_release`` once admitted."""
        fut = asyncio.get_running_loop().create_future()
        self._rank_queue.setdefault(rank, collections.deque()).append((need, fut))
        self._admit_heads(rank)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(rank, need)  # admitted as the client left
            raise

    def rank_load(self, rank: int) -> int:
        """Tokens DP rank ``rank`` holds plus those waiting for room on it (rank_token_budget)."""
        waiting = sum(need for need, fut in self._rank_queue.get(rank, ()) if not fut.done())
        return self.rank_tokens.get(rank, 0) + waiting

    def _admit_heads(self, rank: int) -> None:
        queue, budget = self._rank_queue[rank], self.behavior.rank_token_budget
        while queue:
            need, fut = queue[0]
            used = self.rank_tokens.get(rank, 0)
            if fut.done():  # its client left while it waited
                queue.popleft()
                continue
            if used and used + need > budget:
                return
            queue.popleft()
            self.rank_tokens[rank] = used + need
            fut.set_result(None)

    def _release(self, rank: int, need: int) -> None:
        self.rank_tokens[rank] -= need
        self._admit_heads(rank)

    async def _stream(self, request, rec, body, n):
        b = self.behavior
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i in range(n):
            if i == b.fail_midstream_after:
                # an abrupt failure: the chunked body never ends
                request.transport.abort()
                return resp
            if i and b.token_delay_s:
                await asyncio.sleep(b.token_delay_s)
            event = _chunk(request.path, body, i, n, b.model)
            await resp.write(b"data: " + _encode(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.completed += 1
        return resp


def _max_tokens(body: dict, default: int) -> int:
    for name in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
        if isinstance(body.get(name), int):
            return body[name]
    sp = body.get("sampling_params")
    if isinstance(sp, dict) and isinstance(sp.get("max_new_tokens"), int):
        return sp["max_new_tokens"]
    return default


def _prompt_len(body: dict) -> int:
    for name in ("text", "prompt"):
        if isinstance(body.get(name), str):
            return max(1, len(body[name].split()))
    if isinstance(body.get("input_ids"), list):
        return len(body["input_ids"])
    return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])) or 1


def _text(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


def _final(path: str, body: dict, n: int, model: str, role: str) -> dict:
    rid = f"standin-{body.get('bootstrap_room')}"
    if path == "/generate":
        meta = {"id": rid, "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": _prompt_len(body), "completion_tokens": n}
        if body.get("return_logprob"):
            # a prefill server holds the prompt's logprobs; a decode server has none of them
            meta["input_token_logprobs"] = ([[-0.5, i, None] for i in range(_prompt_len(body))]
                                            if role == "prefill" else [])
            meta["output_token_logprobs"] = [[-0.1, 100 + i, None] for i in range(n)]
        return {"text": _text(n), "output_ids": list(range(100, 100 + n)), "meta_info": meta}
    usage = {"prompt_tokens": _prompt_len(body), "completion_tokens": n,
             "total_tokens": _prompt_len(body) + n}
    if path == "/v1/completions":
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "text": _text(n), "logprobs": None,
                             "finish_reason": "length"}], "usage": usage}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": _text(n)},
                         "logprobs": None, "finish_reason": "length"}], "usage": usage}


def _chunk(path: str, body: dict, i: int, n: int, model: str) -> dict:
    rid = f"standin-{body.get('bootstrap_room')}"
    last = i == n - 1
    if path == "/generate":
        return {"text": _text(i + 1), "output_ids": [100 + i],
                "meta_info": {"id": rid, "completion_tokens": i + 1,
                              "finish_reason": {"type": "length", "length": n} if last else None}}
    if path == "/v1/completions":
        return {"id": rid, "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": f" t{i}", "logprobs": None,
                             "finish_reason": "length" if last else None}]}
    return {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "logprobs": None,
                         "finish_reason": "length" if last else None}]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--num-tokens", type=int, default=Behavior.num_tokens)
    p.add_argument("--dp-size", type=int, default=Behavior.dp_size)
    p.add_argument("--record", action="store_true", help="keep request bodies (memory grows)")
    args = p.parse_args(argv)
    import uvloop

    async def run():
        w = StandinWorker(args.role, Behavior(num_tokens=args.num_tokens, dp_size=args.dp_size,
                                              record=args.record), args.host, args.port)
        await w.start()
        print(f"READY {w.url}", flush=True)
        await asyncio.Event().wait()

    uvloop.run(run())


if __name__ == "__main__":
    main()
