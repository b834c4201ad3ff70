"""Fixtures: stand-in prefill/decode workers and a router, all on real sockets in the test's loop."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.server import start_router
from support.standin_worker import Behavior, StandinWorker

# small backoff and health intervals keep the failure tests fast; a request that finds no healthy
# pair waits 0.2 s for one (test_router_readiness.py tests the wait itself)
FAST = dict(retry_initial_backoff_ms=1.0, retry_max_backoff_ms=5.0, health_check_interval_secs=3600.0,
            health_check_timeout_secs=1.0, request_timeout_secs=10.0, request_queue_timeout_secs=0.2,
            host="127.0.0.1", port=0)


class Cluster:
    def __init__(self):
        self.prefills: list[StandinWorker] = []
        self.decodes: list[StandinWorker] = []
        self.router = None
        self._runner = None
        self.url = None
        self.client: aiohttp.ClientSession | None = None

    async def start(self, n_prefill=1, n_decode=1, prefill_behavior=None, decode_behavior=None,
                    bootstrap_port=8998, **config):
        for i in range(n_prefill):
            w = StandinWorker("prefill", dataclasses.replace(prefill_behavior or Behavior()))
            await w.start()
            self.prefills.append(w)
        for i in range(n_decode):
            w = StandinWorker("decode", dataclasses.replace(decode_behavior or Behavior()))
            await w.start()
            self.decodes.append(w)
        cfg = RouterConfig(
            prefill=tuple(WorkerSpec(w.url, "prefill", bootstrap_port) for w in self.prefills),
            decode=tuple(WorkerSpec(w.url, "decode") for w in self.decodes),
            **{**FAST, **config})
        self.router, self._runner, port = await start_router(cfg)
        self.url = f"http://127.0.0.1:{port}"
        self.client = aiohttp.ClientSession()
        return self

    async def post(self, path, body, headers=None):
        async with self.client.post(self.url + path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def close(self):
        if self.client:
            await self.client.close()
        if self._runner:
            await self._runner.cleanup()
        for w in self.prefills + self.decodes:
            await w.close()


@pytest.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()
