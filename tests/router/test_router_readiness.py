"""Router readiness against stand-in workers on real sockets: workers that start after the router
are probed often (every 0.5 s while never healthy) and serve within a probe gap, not a whole
interval later; ``/readiness`` says what is missing; a request that finds no pair waits for one
(``--request-queue-timeout-secs``); a worker that failed is probed often until it is back.

Which probe put a worker in rotation is read from the health checker's log line (it names the
probe's kind), not from how long it took: a loaded machine stretches the time, not the mechanism."""

import asyncio
import logging
import time

import aiohttp
import pytest

from pdserve.entrypoints.procs import free_port
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.workers import health
from pdserve.router.workers.health import probe_delays
from pdserve.router.server import start_router
from support.health_log import rotation_changes
from support.standin_worker import Behavior, StandinWorker

from conftest import FAST

pytestmark = pytest.mark.timeout(30)


def test_probe_delays_double_from_half_a_second_up_to_the_interval():
    gen = probe_delays(3.0)
    assert [next(gen) for _ in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


class Stand:
    """A router whose prefill and decode stand-ins get fixed ports but start when the test says."""

    def __init__(self, **config):
        self.prefill = StandinWorker("prefill", Behavior(), port=free_port())
        self.decode = StandinWorker("decode", Behavior(), port=free_port())
        self.config = RouterConfig(prefill=(WorkerSpec(self.prefill.url, "prefill", 8998),),
                                   decode=(WorkerSpec(self.decode.url, "decode"),), **{**FAST, **config})
        self.runner = None

    async def __aenter__(self):
        self.router, self.runner, port = await start_router(self.config)
        self.url = f"http://127.0.0.1:{port}"
        self.client = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.runner.cleanup()
        for w in (self.prefill, self.decode):
            await w.close()

    async def get(self, path):
        async with self.client.get(self.url + path) as r:
            return r.status, await r.json(content_type=None)

    async def until(self, cond, timeout=3.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.02)

    async def generate(self):
        async with self.client.post(self.url + "/generate", json={"text": "hi"}) as r:
            return r.status, await r.json(content_type=None)


async def test_workers_started_after_the_router_are_served_within_a_probe_gap(caplog):
    # the interval is sglang-router's default 60 s: before this feature, a worker that did not answer
    # the one probe at start was not probed again for a minute
    caplog.set_level(logging.INFO, logger=health.log.name)
    async with Stand(health_check_interval_secs=60.0) as s:
        status, body = await s.get("/readiness")
        assert status == 503 and body["status"] == "not_ready"
        assert body["missing"] == ["prefill", "decode"]
        assert "no healthy prefill worker (1 registered" in body["message"]
        assert (await s.get("/liveness"))[0] == 200
        assert (await s.get("/health"))[0] == 200  # /health: the router runs (sglang-router's meaning)
        await asyncio.sleep(1.0)
        # not answering yet, so watched: probed at the short startup gap, not the 60 s interval
        assert sorted(s.router.health.watched) == sorted([s.prefill.url, s.decode.url])
        await s.prefill.start()
        await s.decode.start()
        while (await s.get("/readiness"))[0] != 200:
            await asyncio.sleep(0.05)
        # the watching (startup) probes put both in rotation, one change each; no interval probe did
        assert sorted(rotation_changes(caplog.records)) == [("decode", "back in rotation", "startup"),
                                                            ("prefill", "back in rotation", "startup")]
        assert s.prefill.health_checks >= 1 and s.decode.health_checks >= 1
        status, body = await s.generate()  # the first request after readiness succeeds
        assert status == 200 and body["text"] == " t0 t1 t2 t3"
        assert s.router.health.watched == []  # healthy workers are back to the interval


async def test_a_request_waits_for_a_pair_instead_of_failing_at_once():
    async with Stand(health_check_interval_secs=60.0, request_queue_timeout_secs=10.0) as s:
        await s.prefill.start()
        req = asyncio.ensure_future(s.generate())
        await asyncio.sleep(0.8)
        assert not req.done()  # waiting for a decode worker, not failed
        await s.decode.start()
        status, body = await asyncio.wait_for(req, 5.0)
        assert status == 200 and body["text"] == " t0 t1 t2 t3"


async def test_no_pair_within_the_request_queue_timeout_is_a_503_naming_the_missing_role():
    async with Stand(request_queue_timeout_secs=0.5) as s:
        await s.prefill.start()
        await s.until(lambda: s.router.registry.healthy_endpoints("prefill"))
        t0 = time.monotonic()
        status, body = await s.generate()
        waited = time.monotonic() - t0
        assert status == 503 and "no healthy decode worker" in body["error"]["message"]
        assert waited >= 0.45  # it waited out the queue timeout (a loaded machine only adds to it)
        status, body = await s.get("/readiness")
        assert status == 503 and body["missing"] == ["decode"]


async def test_a_failed_worker_is_probed_often_until_it_is_back(caplog):
    # failures are seen at the 3 s interval; the way back is a 0.5 s probe, not the next interval
    caplog.set_level(logging.INFO, logger=health.log.name)
    async with Stand(health_check_interval_secs=3.0, health_failure_threshold=1) as s:
        await s.prefill.start()
        await s.decode.start()
        await s.until(lambda: s.router.gate.is_open)
        assert (await s.get("/readiness"))[0] == 200
        dec = s.router.registry.get(s.decode.url)
        s.decode.behavior.health_status = 503
        await s.until(lambda: not dec.healthy, 5.0)
        assert s.decode.url in s.router.health.watched
        status, body = await s.get("/readiness")
        assert status == 503 and body["missing"] == ["decode"]
        s.decode.behavior.health_status = 200
        await s.until(lambda: dec.healthy, 10.0)
        assert (await s.get("/readiness"))[0] == 200
        # out at an interval probe, back at a watching (backoff) probe, not at the next interval
        assert [p for p in rotation_changes(caplog.records) if p[0] == "decode"][-2:] == [
            ("decode", "out of rotation", "interval"), ("decode", "back in rotation", "backoff")]


async def test_worker_startup_timeout_bounds_the_often_probing():
    async with Stand(health_check_interval_secs=60.0, worker_startup_timeout_secs=1.0) as s:
        assert sorted(s.router.health.watched) == sorted([s.prefill.url, s.decode.url])
        await asyncio.sleep(1.8)  # probes at 0, 0.5, 1.0 s: the next wait passes the 1 s bound
        assert s.router.health.watched == []
        assert (await s.get("/readiness"))[0] == 503


async def test_readiness_and_health_are_open_with_an_api_key(cluster):
    await cluster.start(1, 1, api_key="k")
    for path in ("/readiness", "/liveness", "/health"):
        async with cluster.client.get(cluster.url + path) as r:
            assert r.status == 200, path
