"""Health checks: probe every worker each interval; out of rotation after
``health_failure_threshold`` failures in a row, back after
``health_success_threshold`` passes. A worker's DP size comes from
``/get_server_info`` (``/server_info`` on newer SGLang) the first time it passes."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdserve.router.config import RouterConfig
from pdserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger("pdserve.router.health")


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 config: RouterConfig, headers: dict[str, str]):
        self.registry = registry
        self.session = session
        self.config = config
        self.headers = headers
        self._timeout = aiohttp.ClientTimeout(total=config.health_check_timeout_secs)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_secs)
            await self.check_all()

    async def check_all(self) -> None:
        workers = self.registry.workers()
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def check(self, worker: Worker, first: bool = False) -> bool:
        """Probe one worker and record the result; ``first``: a worker just added counts as
        healthy after one pass, so a router starts serving as soon as its workers answer."""
        ok = await self._get_ok(worker.url + "/health")
        if ok and not worker.info_known:
            ok = await self._fetch_info(worker)
        cfg = self.config
        changed = self.registry.record_health(worker, ok, cfg.health_failure_threshold,
                                              1 if first else cfg.health_success_threshold)
        if changed:
            (log.info if first else log.warning)("%s worker %s is %s", worker.role, worker.url,
                        "back in rotation" if worker.healthy else "out of rotation")
        return ok

    async def _get_ok(self, url: str) -> bool:
        try:
            async with self.session.get(url, headers=self.headers, timeout=self._timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _fetch_info(self, worker: Worker) -> bool:
        for path in ("/get_server_info", "/server_info"):
            try:
                async with self.session.get(worker.url + path, headers=self.headers,
                                            timeout=self._timeout) as resp:
                    if resp.status != 200:
                        continue
                    info = await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                continue
            if isinstance(info, dict):
                model = info.get("model_path") or info.get("served_model_name")
                self.registry.set_server_info(worker, info.get("dp_size") or 1, model)
                return True
        log.warning("%s answers /health but neither /get_server_info nor /server_info", worker.url)
        # a server without server info still serves: assume one DP rank
        self.registry.set_server_info(worker, 1)
        return True
