"""The router's admin API: the worker registry (add, remove, drain, undrain) and the control
routes fanned out to every worker (router/fanout.py).

Every route here changes the router or its workers, so every one passes ``Access.check_admin``
(router/auth.py): ``--admin-api-key`` when set, else loopback peers only. ``GET /workers`` only
reads, and takes the inference key like the inference routes.

    POST   /workers            {"url", "role" (or SGLang's "worker_type"), "bootstrap_port"}
    DELETE /workers/{url}      the url percent-encoded
    POST   /workers/drain      {"url", "wait_secs"}: no new requests; answers once drained or
                               wait_secs passed, and says which ("drained")
    POST   /workers/undrain    {"url"}
    POST   /flush_cache, /update_weights_from_disk, /release_memory_occupation,
           /resume_memory_occupation, /load_lora_adapter, /unload_lora_adapter: the body to
           every worker (router/fanout.py); the LoRA answers update the adapter table
"""

from __future__ import annotations

import logging
from urllib.parse import unquote

import msgspec
from aiohttp import web

from pdserve.router.config import WorkerSpec
from pdserve.router.workers.drain import drain_worker
from pdserve.router.errors import RouterError, bad_request, error_response
from pdserve.router.fanout import FANOUT_PATHS, LORA_PATHS, fan_out
from pdserve.router.http_io import json_response, read_body
from pdserve.router.workers.adapters import loaded_adapters
from pdserve.router.workers.worker_registry import Worker

log = logging.getLogger("pdserve.router")
_decode = msgspec.json.decode


class AdminApi:
    def __init__(self, router):
        """``router``: the Router (router/server.py) whose registry, health checker, policies,
        client session and access checks these routes use."""
        self.router = router

    def add_routes(self, r: web.UrlDispatcher) -> None:
        for path in FANOUT_PATHS:
            r.add_post(path, self._fan_out)
        r.add_get("/workers", self._list_workers)
        r.add_post("/workers", self._add_worker)
        r.add_post("/workers/drain", self._drain_worker)
        r.add_post("/workers/undrain", self._undrain_worker)
        r.add_delete("/workers/{url:.+}", self._remove_worker)

    async def _admin_body(self, request: web.Request) -> bytes:
        """The body of an admin call, once the caller is known to be an operator."""
        self.router.access.check_admin(request)
        return await read_body(request, self.router.config.max_payload_size,
                               self.router.config.http_read_timeout)

    async def _fan_out(self, request: web.Request) -> web.Response:
        """A control operation for every worker (router/fanout.py)."""
        try:
            body = await self._admin_body(request)
        except RouterError as err:
            return error_response(err)
        router = self.router
        workers = router.registry.workers()
        if not workers:
            return error_response(RouterError(503, "no worker registered", "service_unavailable"))
        status, answer = await fan_out(router.session, workers, request.path, body or b"{}",
                                       router.control_headers, router.config.max_response_bytes)
        if request.path in LORA_PATHS:  # each worker answered with the adapters it now holds
            for result in answer["workers"]:
                loaded = loaded_adapters(result["body"])
                if loaded is not None:
                    router.adapters.set_loaded(result["url"], loaded)
        return json_response(answer, status)

    async def _list_workers(self, request: web.Request) -> web.Response:
        try:
            self.router.access.check_inference(request)
        except RouterError as err:
            return error_response(err)
        registry = self.router.registry
        return json_response({role: [w.to_json() for w in registry.workers(role)]
                              for role in ("prefill", "decode")})

    async def _add_worker(self, request: web.Request) -> web.Response:
        router = self.router
        try:
            body = await self._url_body(request, "expected a JSON object with 'url' and 'role'")
            try:
                spec = WorkerSpec(body["url"], body.get("role") or body.get("worker_type") or "",
                                  body.get("bootstrap_port"))
            except (ValueError, TypeError) as e:
                raise bad_request(str(e)) from None
            try:
                worker = router.registry.add(spec)
            except ValueError as e:
                raise RouterError(409, str(e), "conflict", "url") from None
        except RouterError as err:
            return error_response(err)
        await router.health.check(worker, first=True)
        if not worker.healthy:
            router.health.watch(worker, first=True)
        log.info("added %s worker %s (healthy=%s)", worker.role, worker.url, worker.healthy)
        return json_response(worker.to_json())

    async def _url_body(self, request: web.Request, expected: str) -> dict:
        """The JSON object body of a /workers call, which must name a worker ``url``."""
        try:
            body = _decode(await self._admin_body(request))
        except msgspec.DecodeError as e:
            raise bad_request(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise bad_request(expected, "url")
        return body

    async def _worker_from_body(self, request: web.Request) -> tuple[dict, Worker]:
        """The JSON body of a /workers/drain or /workers/undrain call and the worker its url names."""
        body = await self._url_body(request, "expected a JSON object with 'url'")
        worker = self.router.registry.get(body["url"])
        if worker is None:
            raise RouterError(404, f"no worker {body['url']}", "not_found", "url")
        return body, worker

    async def _drain_worker(self, request: web.Request) -> web.Response:
        try:
            body, worker = await self._worker_from_body(request)
            wait = body.get("wait_secs", 0)
            if not isinstance(wait, (int, float)) or wait < 0:
                raise bad_request("wait_secs must be a number >= 0", "wait_secs")
        except RouterError as err:
            return error_response(err)
        log.info("draining %s worker %s (%d requests in flight)", worker.role, worker.url, worker.load)
        return json_response(await drain_worker(self.router.registry, worker, float(wait)))

    async def _undrain_worker(self, request: web.Request) -> web.Response:
        """A drained worker (restarted, say) takes new requests again."""
        try:
            _, worker = await self._worker_from_body(request)
        except RouterError as err:
            return error_response(err)
        self.router.registry.set_draining(worker, False)
        if not worker.healthy:
            self.router.health.watch(worker)
        log.info("%s worker %s takes requests again", worker.role, worker.url)
        return json_response(worker.to_json())

    async def _remove_worker(self, request: web.Request) -> web.Response:
        router = self.router
        try:
            router.access.check_admin(request)
        except RouterError as err:
            return error_response(err)
        url = unquote(request.match_info["url"])
        worker = router.registry.remove(url)
        if worker is None:
            return error_response(RouterError(404, f"no worker {url}", "not_found", "url"))
        # both: the prefill policy (kv_aware) also follows decode workers' events for local prefill
        for policy in (router.prefill_policy, router.decode_policy):
            for ep in worker.endpoints:
                policy.forget(ep.key)
        router.adapters.forget(worker.url)
        log.info("removed %s worker %s (%d requests in flight finish there)", worker.role,
                 worker.url, worker.load)
        return json_response(worker.to_json())
