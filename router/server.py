"""The router's HTTP server: the inference endpoint, probes, admission and lifecycle.

An inference request passes the inference key (router/auth.py), takes an admission slot
(``--max-concurrent-requests``, router/admission.py) and only then has its body read, within
``--max-payload-size`` (router/http_io.py); with tenants (``--tenant-config``, ``--tenant-header``,
``--slo-ttft-ms``) the body is read first, for its tokens, and the slot comes from
router/admission_tenants.py. The routes that change the router or its workers
live in router/admin_api.py.

``Router(config)`` owns the worker registry, the policies, the health checker
and one pooled aiohttp client session; ``await router.start()`` probes the
configured workers once, keeps probing those not healthy yet (router/workers/health.py)
and starts the health loop; ``router.make_app()`` is the aiohttp application.
``serve(config)`` runs it all on uvloop, and on SIGTERM drains (router/workers/drain.py).

Probes: ``/liveness`` is 200 while the process runs; ``/readiness`` is 200 only
while a healthy prefill+decode pair exists and the router is not draining
(router/workers/readiness.py); ``/health`` keeps sglang-router's meaning: 200 while the
router runs, with the healthy endpoints per role; ``/health_generate`` is 200 only
when every worker generates a token now (router/workers/health_generate.py).

Every error leaves as the JSON error object, an unknown path (404) or a wrong
method (405) included (``json_errors``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time

import aiohttp
import msgspec
from aiohttp import web

from pdserve.engine.http_json_errors import json_error_middleware
from pdserve.engine.http_site import serve_limited
from pdserve.engine.lora_names import parse_lora_paths
from pdserve.router.admin_api import AdminApi
from pdserve.engine.tracing import Tracer, make_tracer
from pdserve.router.admission import Admission
from pdserve.router.admission_tenants import Admitted, TenantGate
from pdserve.router.admission_fair_metrics import TenancyFamiliesOff
from pdserve.router.trace_spans import child_span, request_span
from pdserve.router.admission_metrics import AdmissionGauges
from pdserve.router.auth import Access
from pdserve.router.config import RouterConfig
from pdserve.router.workers.drain import CUT_OFF_GRACE_S, Shutdown, remember_response
from pdserve.router.errors import RouterError, bad_request, error_response
from pdserve.router.workers.health import HealthChecker
from pdserve.router.workers.health_generate import health_generate
from pdserve.router.http_io import json_response, read_body, read_capped
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers.pairing import Pairing
from pdserve.router.pd_proxy import PDProxy
from pdserve.router.policy import make_policy
from pdserve.router.prompt_tokenizer import PromptTokenizer
from pdserve.router.request_priority import request_priority
from pdserve.router.tenancy.slo import SLO_HEADER
from pdserve.router.workers.readiness import PairGate, describe_missing, readiness
from pdserve.router.upstream import UpstreamPool
from pdserve.router.workers.adapter_sync import AdapterSync
from pdserve.router.workers.adapters import AdapterTable
from pdserve.router.workers.worker_registry import WorkerRegistry
from pdserve.router.workers.dp_rank_choice import DpRankChoice

log = logging.getLogger("pdserve.router")
_decode = msgspec.json.decode
_encode = msgspec.json.encode
INFERENCE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# a request leaves ~12 container objects to the cyclic collector: at CPython's default 700 a
# collection every ~60 requests, and every hundredth of them walks the whole start-up heap (8 us
# per request, measured); frozen start-up objects and a larger first generation take that to ~0
GC_GEN0_THRESHOLD = 20_000
ADMITTED_KEY = web.RequestKey("pdserve.admitted", Admitted)  # the request's tenant-admission slot


def _render_error(status: int, message: str) -> web.Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request_error")
    return error_response(RouterError(status, message, kind))


json_errors = json_error_middleware(_render_error)  # aiohttp's own answers as the JSON error object


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.registry = WorkerRegistry(config.dp_aware)
        self.prefill_policy = make_policy(config.effective_prefill_policy, config)
        self.decode_policy = make_policy(config.effective_decode_policy, config)
        # --local-prefill-max-tokens counts prompts: with the prefill policy's tokenizer if it has one
        self.prompt_tokenizer = (PromptTokenizer(config.tokenizer_path)
                                 if config.local_prefill_max_tokens and not self.prefill_policy.tokenizes else None)
        # the workers' LoRA adapters (router/workers/adapters.py), read by the health probes
        self.adapters = AdapterTable(parse_lora_paths(config.lora_paths))
        self.adapter_sync: AdapterSync | None = None
        self.pairing = Pairing(self.registry, self.prefill_policy, self.decode_policy,
                               prompt_tokenizer=self.prompt_tokenizer, adapters=self.adapters,
                               dp_ranks=DpRankChoice(config.dp_rank_policy))
        self.metrics = RouterMetrics(self.registry, {"prefill": self.prefill_policy, "decode": self.decode_policy},
                                     INFERENCE_ROUTES)
        # with tenants the queue is shared fairly between them (router/admission_tenants.py)
        self.tenants = TenantGate(config, self.metrics.registry) if config.tenancy else None
        self.admission = (self.tenants.admission if self.tenants is not None else
                          Admission(config.max_concurrent_requests, config.queue_size,
                                    config.queue_timeout_secs, config.schedule_low_priority_values_first))
        self.metrics.registry.register(AdmissionGauges(self.admission))
        if self.tenants is None:  # the tenant families, all requests the default tenant's
            self.metrics.registry.register(TenancyFamiliesOff(self.admission))
        self.gate = PairGate(self.registry)
        self.registry.on_change(self._prepare_routing)
        self.shutdown = Shutdown(config.graceful_shutdown_timeout)
        self.access = Access(config.api_key, config.admin_api_key)
        # the workers get the router's inference key, and its admin key on the control routes
        # fanned out to them (each falls back to the other when only one is set)
        self.worker_headers = {"Content-Type": "application/json"}
        self.control_headers = {"Content-Type": "application/json"}
        inference_key = config.api_key or config.admin_api_key
        control_key = config.admin_api_key or config.api_key
        if inference_key:
            self.worker_headers["Authorization"] = f"Bearer {inference_key}"
        if control_key:
            self.control_headers["Authorization"] = f"Bearer {control_key}"
        self.admin_api = AdminApi(self)
        # --enable-trace: the request's spans (router/trace_spans.py); None: tracing off
        self.tracer: Tracer | None = make_tracer(config.trace, "pdserve-router")
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
        self.upstream = UpstreamPool(self.config.request_timeout_secs, extra_headers=auth,
                                     max_response_bytes=self.config.max_response_bytes)
        self.adapter_sync = AdapterSync(self.adapters, self.session, self.worker_headers, self.control_headers,
                                        self.config.health_check_timeout_secs)
        self.proxy = PDProxy(self.config, self.pairing, self.metrics, self.upstream, self.tracer,
                             adapters=self.adapter_sync)
        if self.prompt_tokenizer is not None and self.config.tokenizer_path:
            self.prompt_tokenizer.start(None)
        self.health = HealthChecker(self.registry, self.session, self.config, self.worker_headers,
                                    after_pass=self.adapter_sync.refresh)
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
        if self.tracer is not None:
            self.tracer.shutdown()  # exports the spans still batched
            self.tracer = None

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_payload_size, middlewares=[json_errors])
        r = app.router
        for path in INFERENCE_ROUTES:
            r.add_post(path, self._inference)
        r.add_get("/v1/models", self._models)
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            r.add_get(path, self._forward_one)
        for path in ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"):
            r.add_post(path, self._forward_one)
        self.admin_api.add_routes(r)
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health_generate)
        r.add_get("/liveness", self._liveness)
        r.add_get("/readiness", self._readiness)
        r.add_get("/metrics", self._metrics)
        app.on_response_prepare.append(remember_response)
        app.on_response_prepare.append(self._first_byte)
        app.on_cleanup.append(lambda _app: self.close())
        return app

    # request path ------------------------------------------------------------
    async def _inference(self, request: web.Request) -> web.StreamResponse:
        if self.tracer is None:
            return await self._serve(request)
        with request_span(self.tracer, request.headers, request.path) as span:
            resp = await self._serve(request)
            span.set_attribute("http.status_code", resp.status)
            return resp

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.path
        admitted = entered = False
        held: Admitted | None = None
        status = 500
        try:
            self.shutdown.enter()
            entered = True
            key_tenant = self._check_inference(request)
            priority = request_priority(request.headers, self.config.enable_priority_scheduling)
            if self.tenants is None:
                if SLO_HEADER in request.headers:
                    raise bad_request(f"header {SLO_HEADER} needs a router started with --slo-ttft-ms "
                                      "(or --tenant-config, --tenant-header)", SLO_HEADER)
                # the slot before the body: concurrent uploads wait in the queue, not in memory
                with child_span(self.tracer, "router.queue"):
                    await self.admission.acquire(priority)
                admitted = True
                body = await self._read_json(request)
            else:  # the body first: its tokens are the tenant's fair-share charge
                tenant = self.tenants.namer.tenant(request.headers, key_tenant)
                body = await self._read_json(request)
                with child_span(self.tracer, "router.queue"):
                    held = await self.tenants.admit(tenant, request.headers, body, priority, t0)
                request[ADMITTED_KEY] = held
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
            if held is not None:
                self.tenants.release(held, failed=status >= 400)
            self.metrics.requests.inc(route, str(status))
            self.metrics.e2e.observe(time.perf_counter() - t0)

    def _check_inference(self, request: web.Request) -> str | None:
        """Pass the inference key, or a tenant's key (then its tenant is returned); else a 401."""
        key_tenant = self.tenants.key_tenant(request.headers) if self.tenants is not None else None
        if key_tenant is None:
            self.access.check_inference(request)
        return key_tenant

    async def _read_json(self, request: web.Request) -> dict:
        raw = await read_body(request, self.config.max_payload_size, self.config.http_read_timeout)
        try:
            body = _decode(raw)
        except msgspec.DecodeError as e:
            raise bad_request(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the JSON body must be an object")
        return body

    async def _first_byte(self, request: web.Request, response: web.StreamResponse) -> None:
        """The answer's head leaves: with tenants, the TTFT sample and the SLO outcome."""
        held = request.get(ADMITTED_KEY)
        if held is not None:
            self.tenants.first_byte(held, response.status)

    # other endpoints --------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        counts = {role: len(self.registry.healthy_endpoints(role)) for role in ("prefill", "decode")}
        return json_response({"status": "ok", "healthy_endpoints": counts})

    async def _health_generate(self, request: web.Request) -> web.Response:
        """200 when every worker that is not draining generated a token now; else 503 with each one's answer."""
        try:
            self._check_inference(request)
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

    async def _models(self, request: web.Request) -> web.Response:
        """A healthy worker's ``/v1/models`` with the adapters it lists replaced by the union of
        every worker's (each a card whose parent is the base model)."""
        resp = await self._forward_one(request)
        if resp.status != 200 or not self.adapters.active:
            return resp
        try:
            payload = _decode(resp.body)
        except msgspec.DecodeError:
            return resp
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return resp
        bases = [c for c in data if isinstance(c, dict) and c.get("parent") is None]
        if not bases:
            return resp
        base = bases[0]
        adapters = [{**base, "id": name, "root": path, "parent": base.get("id")}
                    for name, path in sorted(self.adapters.union().items())]
        return json_response({**payload, "data": [*bases, *adapters]})

    async def _forward_one(self, request: web.Request) -> web.Response:
        """Model and server info, and (de)tokenization, come from a healthy worker (decode first: it
        serves the answers)."""
        admitted = False
        try:
            self._check_inference(request)
            await self.admission.acquire(
                request_priority(request.headers, self.config.enable_priority_scheduling))
            admitted = True
            body = await read_body(request, self.config.max_payload_size, self.config.http_read_timeout) if request.method == "POST" else None
            endpoints = self.registry.healthy_endpoints("decode") or self.registry.healthy_endpoints("prefill")
            if not endpoints:
                raise RouterError(503, "no healthy worker available", "service_unavailable")
            url = endpoints[0].worker.url + request.path
            try:
                async with self.session.request(request.method, url, data=body,
                                                headers=self.worker_headers) as resp:
                    data = await read_capped(resp, self.config.max_response_bytes)
                    return web.Response(body=data, status=resp.status,
                                        content_type=resp.content_type or "application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise RouterError(502, f"{url}: {type(e).__name__}: {e}", "upstream_error") from None
        except RouterError as err:
            return error_response(err)
        finally:
            if admitted:
                self.admission.release()


async def start_router(config: RouterConfig, host: str | None = None,
                       port: int | None = None) -> tuple[Router, web.AppRunner, int]:
    """Start a router in the running loop (tests, embedding); returns (router, runner, port)."""
    router = Router(config)
    await router.start()
    runner = await serve_limited(router.make_app(), host or config.host, config.port if port is None else port,
                                 config.http_limits, backlog=2048, handler_cancellation=True, access_log=None)
    return router, runner, runner.addresses[0][1]  # the bound port (port 0: chosen by the OS)


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted (the CLI's entry)."""
    import uvloop

    async def run():
        router, runner, port = await start_router(config)
        gc.freeze()  # what start-up built lives as long as the router: no collection walks it again
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
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
