"""The router's HTTP server: endpoints, admission (auth, payload size, concurrency) and lifecycle.

``Router(config)`` owns the worker registry, the policies, the health checker
and one pooled aiohttp client session; ``await router.start()`` probes the
configured workers once, keeps probing those not healthy yet (router/health.py)
and starts the health loop; ``router.make_app()`` is the aiohttp application.
``serve(config)`` runs it all on uvloop, and on SIGTERM drains (router/drain.py).

Probes: ``/liveness`` is 200 while the process runs; ``/readiness`` is 200 only
while a healthy prefill+decode pair exists and the router is not draining
(router/readiness.py); ``/health`` keeps sglang-router's meaning: 200 while the
router runs, with the healthy endpoints per role; ``/health_generate`` is 200 only
when every worker generates a token now (router/health_generate.py).

Every error leaves as the JSON error object, an unknown path (404) or a wrong
method (405) included (``json_errors``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from urllib.parse import unquote

import aiohttp
import msgspec
from aiohttp import web

from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.drain import CUT_OFF_GRACE_S, Shutdown, drain_worker, remember_response
from pdserve.router.fanout import FANOUT_PATHS, fan_out
from pdserve.router.errors import RouterError, bad_request, error_response, payload_too_large, unauthorized
from pdserve.router.health import HealthChecker
from pdserve.router.health_generate import health_generate
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import Pairing
from pdserve.router.pd_proxy import PDProxy
from pdserve.router.policy import make_policy
from pdserve.router.prompt_tokenizer import PromptTokenizer
from pdserve.router.readiness import PairGate, describe_missing, readiness
from pdserve.router.upstream import UpstreamPool
from pdserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger("pdserve.router")
_decode = msgspec.json.decode
_encode = msgspec.json.encode
INFERENCE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


@web.middleware
async def json_errors(request: web.Request, handler):
    """aiohttp's own answers (no such path, wrong method, ...) as the JSON error object."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "invalid_request_error")
        return error_response(RouterError(e.status, f"{e.reason}: {request.method} {request.path}", kind))


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.registry = WorkerRegistry(config.dp_aware)
        self.prefill_policy = make_policy(config.effective_prefill_policy, config)
        self.decode_policy = make_policy(config.effective_decode_policy, config)
        self.pairing = Pairing(self.registry, self.prefill_policy, self.decode_policy)
        self.metrics = RouterMetrics(self.registry, {"prefill": self.prefill_policy, "decode": self.decode_policy},
                                     INFERENCE_ROUTES)
        self.admission = Admission(config.max_concurrent_requests, config.queue_size,
                                   config.queue_timeout_secs)
        self.gate = PairGate(self.registry)
        # --local-prefill-max-tokens counts prompts: with the prefill policy's tokenizer if it has one
        self.prompt_tokenizer = (PromptTokenizer(config.tokenizer_path)
                                 if config.local_prefill_max_tokens and not self.prefill_policy.tokenizes else None)
        self.registry.on_change(self._prepare_routing)
        self.shutdown = Shutdown(config.graceful_shutdown_timeout)
        self.worker_headers = {"Content-Type": "application/json"}
        if config.api_key:
            self.worker_headers["Authorization"] = f"Bearer {config.api_key}"
        self._auth = f"Bearer {config.api_key}" if config.api_key else None
        self.session: aiohttp.ClientSession | None = None
        self.proxy: PDProxy | None = None
        self.upstream: UpstreamPool | None = None
        self.health: HealthChecker | None = None
        self._health_task: asyncio.Task | None = None

    # lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60,
                                         enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_secs, sock_connect=10)
        # no cookies, no decompression, no auto headers: the legs are plain JSON posts
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                             skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))
        auth = {k: v for k, v in self.worker_headers.items() if k == "Authorization"}
        self.upstream = UpstreamPool(self.config.request_timeout_secs, extra_headers=auth)
        self.proxy = PDProxy(self.config, self.pairing, self.metrics, self.upstream, self.prompt_tokenizer)
        if self.prompt_tokenizer is not None and self.config.tokenizer_path:
            self.prompt_tokenizer.start(None)
        self.health = HealthChecker(self.registry, self.session, self.config, self.worker_headers)
        for spec in self.config.prefill + self.config.decode:
            self.registry.add(spec)
        workers = self.registry.workers()
        if workers:
            await asyncio.gather(*(self.health.check(w, first=True) for w in workers))
        for w in workers:
            if not w.healthy:
                log.warning("%s worker %s does not answer /health yet", w.role, w.url)
                self.health.watch(w, first=True)
        self._health_task = asyncio.ensure_future(self.health.run())

    def _prepare_routing(self) -> None:
        """On every change of the healthy endpoints: the policies load what they need about them
        (kv_aware: tokenizer, event streams) and the prompt tokenizer starts loading, so routing is
        ready when the workers are, not at the first request."""
        for role, policy in (("prefill", self.prefill_policy), ("decode", self.decode_policy)):
            endpoints = self.registry.healthy_endpoints(role)
            if endpoints:
                policy.prepare(endpoints)
        if self.prompt_tokenizer is not None:
            known = [w for w in self.registry.workers() if w.info_known]
            if known:
                self.prompt_tokenizer.start(known[0].model_path)

    def routing_missing(self) -> str | None:
        """What the router still loads before it routes as configured (a tokenizer), or None."""
        for role, policy in (("prefill", self.prefill_policy), ("decode", self.decode_policy)):
            if not policy.ready:
                return f"the {role} policy's tokenizer is loading"
        tok = self.prompt_tokenizer
        if tok is not None and not tok.ready and tok.error is None:
            return "the tokenizer for --local-prefill-max-tokens is loading"
        return None

    async def close(self) -> None:
        if self.health is not None:
            self.health.close()
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        for policy in (self.prefill_policy, self.decode_policy):
            policy.close()
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_payload_size, middlewares=[json_errors])
        r = app.router
        for path in INFERENCE_ROUTES:
            r.add_post(path, self._inference)
        r.add_get("/v1/models", self._forward_one)
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            r.add_get(path, self._forward_one)
        for path in ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"):
            r.add_post(path, self._forward_one)
        for path in FANOUT_PATHS:
            r.add_post(path, self._fan_out)
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health_generate)
        r.add_get("/liveness", self._liveness)
        r.add_get("/readiness", self._readiness)
        r.add_get("/metrics", self._metrics)
        r.add_get("/workers", self._list_workers)
        r.add_post("/workers", self._add_worker)
        r.add_post("/workers/drain", self._drain_worker)
        r.add_post("/workers/undrain", self._undrain_worker)
        r.add_delete("/workers/{url:.+}", self._remove_worker)
        app.on_response_prepare.append(remember_response)
        app.on_cleanup.append(lambda _app: self.close())
        return app

    # request path ------------------------------------------------------------
    async def _inference(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.path
        admitted = entered = False
        status = 500
        try:
            self.shutdown.enter()
            entered = True
            self._check_auth(request)
            raw = await self._read_body(request)
            try:
                body = _decode(raw)
            except msgspec.DecodeError as e:
                raise bad_request(f"invalid JSON body: {e}") from None
            if not isinstance(body, dict):
                raise bad_request("the JSON body must be an object")
            await self.admission.acquire()
            admitted = True
            if not self.gate.is_open:  # workers starting or restarting: wait for a pair
                await self.gate.wait(self.config.request_queue_timeout_secs)
            resp = await self.proxy.handle(request, route, body, t0)
            status = resp.status
            return resp
        except RouterError as err:
            status = err.status
            return error_response(err)
        except (ConnectionResetError, asyncio.CancelledError):
            if self.shutdown.expired and entered:
                # cancelled by the graceful-shutdown timeout, not by the client: end it with an error
                asyncio.current_task().uncancel()
                status = 503
                return await self.shutdown.cut_off(request)
            status = 499  # the client went away; the legs are already cancelled
            raise
        finally:
            if entered:
                self.shutdown.leave()
            if admitted:
                self.admission.release()
            self.metrics.requests.inc(route, str(status))
            self.metrics.e2e.observe(time.perf_counter() - t0)

    def _check_auth(self, request: web.Request) -> None:
        if self._auth is not None and request.headers.get("Authorization") != self._auth:
            raise unauthorized()

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_payload_size
        if request.content_length is not None and request.content_length > limit:
            raise payload_too_large(limit)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise payload_too_large(limit) from None

    # other endpoints --------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        counts = {role: len(self.registry.healthy_endpoints(role)) for role in ("prefill", "decode")}
        return json_response({"status": "ok", "healthy_endpoints": counts})

    async def _health_generate(self, request: web.Request) -> web.Response:
        """200 when every worker that is not draining generated a token now; else 503 with each one's answer."""
        try:
            self._check_auth(request)
        except RouterError as err:
            return error_response(err)
        status, body = await health_generate(self.session, self.registry.workers(), self.worker_headers)
        return json_response(body, status)

    async def _liveness(self, request: web.Request) -> web.Response:
        return json_response({"status": "alive"})

    async def _readiness(self, request: web.Request) -> web.Response:
        """200 when a healthy prefill+decode pair exists and the router is not draining; otherwise
        503 with what is missing (for a load balancer or a Kubernetes readiness probe)."""
        ready, body = readiness(self.registry)
        if self.shutdown.draining:
            return json_response({"status": "draining", "message": "the router is shutting down",
                                  "in_flight": self.shutdown.in_flight, **body}, 503)
        if not ready:
            return json_response({"status": "not_ready", "message": describe_missing(body), **body}, 503)
        loading = self.routing_missing()
        if loading is not None:
            return json_response({"status": "not_ready", "message": loading, **body}, 503)
        return json_response({"status": "ready", **body})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _forward_one(self, request: web.Request) -> web.Response:
        """Model and server info, and (de)tokenization, come from a healthy worker (decode first: it
        serves the answers)."""
        try:
            self._check_auth(request)
            body = await self._read_body(request) if request.method == "POST" else None
        except RouterError as err:
            return error_response(err)
        endpoints = self.registry.healthy_endpoints("decode") or self.registry.healthy_endpoints("prefill")
        if not endpoints:
            return error_response(RouterError(503, "no healthy worker available", "service_unavailable"))
        url = endpoints[0].worker.url + request.path
        try:
            async with self.session.request(request.method, url, data=body, headers=self.worker_headers) as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status,
                                    content_type=resp.content_type or "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return error_response(RouterError(502, f"{url}: {type(e).__name__}: {e}", "upstream_error"))

    async def _fan_out(self, request: web.Request) -> web.Response:
        """A control operation for every worker (router/fanout.py)."""
        try:
            self._check_auth(request)
            body = await self._read_body(request)
        except RouterError as err:
            return error_response(err)
        workers = self.registry.workers()
        if not workers:
            return error_response(RouterError(503, "no worker registered", "service_unavailable"))
        status, answer = await fan_out(self.session, workers, request.path, body or b"{}", self.worker_headers)
        return json_response(answer, status)

    async def _list_workers(self, request: web.Request) -> web.Response:
        try:
            self._check_auth(request)
        except RouterError as err:
            return error_response(err)
        return json_response({role: [w.to_json() for w in self.registry.workers(role)]
                              for role in ("prefill", "decode")})

    async def _add_worker(self, request: web.Request) -> web.Response:
        """Body: {"url", "role" (or SGLang's "worker_type"): "prefill"|"decode", "bootstrap_port"}."""
        try:
            self._check_auth(request)
            body = await self._url_body(request, "expected a JSON object with 'url' and 'role'")
            try:
                spec = WorkerSpec(body["url"], body.get("role") or body.get("worker_type") or "",
                                  body.get("bootstrap_port"))
            except (ValueError, TypeError) as e:
                raise bad_request(str(e)) from None
            try:
                worker = self.registry.add(spec)
            except ValueError as e:
                raise RouterError(409, str(e), "conflict", "url") from None
        except RouterError as err:
            return error_response(err)
        await self.health.check(worker, first=True)
        if not worker.healthy:
            self.health.watch(worker, first=True)
        log.info("added %s worker %s (healthy=%s)", worker.role, worker.url, worker.healthy)
        return json_response(worker.to_json())

    async def _url_body(self, request: web.Request, expected: str) -> dict:
        """The JSON object body of a /workers call, which must name a worker ``url``."""
        try:
            body = _decode(await self._read_body(request))
        except msgspec.DecodeError as e:
            raise bad_request(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise bad_request(expected, "url")
        return body

    async def _worker_from_body(self, request: web.Request) -> tuple[dict, Worker]:
        """The JSON body of a /workers/drain or /workers/undrain call and the worker its url names."""
        self._check_auth(request)
        body = await self._url_body(request, "expected a JSON object with 'url'")
        worker = self.registry.get(body["url"])
        if worker is None:
            raise RouterError(404, f"no worker {body['url']}", "not_found", "url")
        return body, worker

    async def _drain_worker(self, request: web.Request) -> web.Response:
        """Body: {"url", "wait_secs" (optional, default 0)}. No new requests go to the worker; the
        answer comes once it is drained or ``wait_secs`` passed, and says which ("drained")."""
        try:
            body, worker = await self._worker_from_body(request)
            wait = body.get("wait_secs", 0)
            if not isinstance(wait, (int, float)) or wait < 0:
                raise bad_request("wait_secs must be a number >= 0", "wait_secs")
        except RouterError as err:
            return error_response(err)
        log.info("draining %s worker %s (%d requests in flight)", worker.role, worker.url, worker.load)
        return json_response(await drain_worker(self.registry, worker, float(wait)))

    async def _undrain_worker(self, request: web.Request) -> web.Response:
        """Body: {"url"}. A drained worker (restarted, say) takes new requests again."""
        try:
            _, worker = await self._worker_from_body(request)
        except RouterError as err:
            return error_response(err)
        self.registry.set_draining(worker, False)
        if not worker.healthy:
            self.health.watch(worker)
        log.info("%s worker %s takes requests again", worker.role, worker.url)
        return json_response(worker.to_json())

    async def _remove_worker(self, request: web.Request) -> web.Response:
        try:
            self._check_auth(request)
        except RouterError as err:
            return error_response(err)
        url = unquote(request.match_info["url"])
        worker = self.registry.remove(url)
        if worker is None:
            return error_response(RouterError(404, f"no worker {url}", "not_found", "url"))
        # both: the prefill policy (kv_aware) also follows decode workers' events for local prefill
        for policy in (self.prefill_policy, self.decode_policy):
            for ep in worker.endpoints:
                policy.forget(ep.key)
        log.info("removed %s worker %s (%d requests in flight finish there)", worker.role,
                 worker.url, worker.load)
        return json_response(worker.to_json())


async def start_router(config: RouterConfig, host: str | None = None,
                       port: int | None = None) -> tuple[Router, web.AppRunner, int]:
    """Start a router in the running loop (tests, embedding); returns (router, runner, port)."""
    router = Router(config)
    await router.start()
    runner = web.AppRunner(router.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or config.host, config.port if port is None else port,
                       backlog=2048)
    await site.start()
    return router, runner, runner.addresses[0][1]  # the bound port (port 0: chosen by the OS)


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted (the CLI's entry)."""
    import uvloop

    async def run():
        router, runner, port = await start_router(config)
        log.info("router listening on %s:%d; prefill %s; decode %s", config.host, port,
                 [w.url for w in router.registry.workers("prefill")],
                 [w.url for w in router.registry.workers("decode")])
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal cuts the drain short
                loop.add_signal_handler(sig, router.shutdown.hurry)
            await router.shutdown.drain()
            left = await router.proxy.finish_background(CUT_OFF_GRACE_S)
            if left:
                log.warning("%d prefill leg(s) still answering at exit are cut", left)
        finally:
            await runner.cleanup()

    try:
        uvloop.run(run())
    except KeyboardInterrupt:
        pass
