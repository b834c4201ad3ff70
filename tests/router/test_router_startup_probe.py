"""A worker that was never healthy is probed at a fixed 0.5 s (``health.STARTUP_PROBE_S``) until
``--worker-startup-timeout-secs``, however long it takes to load: a router started with workers that
answer after 15 s is ready within that interval of them (issue 27; the doubling backoff left a
16 s gap). Backoff is only for workers that were healthy and failed."""

import asyncio
import time

import aiohttp
import pytest

from pdserve.entrypoints.procs import free_port
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.workers.health import STARTUP_PROBE_S, startup_probe_delays
from pdserve.router.server import start_router
from pdserve.router.workers.worker_registry import WorkerRegistry
from standin_worker import Behavior, StandinWorker

from conftest import FAST

LOAD_S = 15.0  # how long the stand-ins "load"


def test_startup_probes_are_fixed_and_at_most_a_second():
    gen = startup_probe_delays()
    assert [next(gen) for _ in range(50)] == [STARTUP_PROBE_S] * 50
    assert STARTUP_PROBE_S <= 1.0


def test_ever_healthy_is_set_by_the_first_pass_only():
    reg = WorkerRegistry()
    w = reg.add(WorkerSpec("http://127.0.0.1:1", "decode"))
    assert not w.ever_healthy
    reg.record_health(w, False, 1, 1)
    assert not w.ever_healthy
    reg.record_health(w, True, 1, 1)
    reg.record_health(w, False, 1, 1)
    assert w.ever_healthy and not w.healthy


@pytest.mark.timeout(60)
async def test_router_is_ready_within_the_probe_interval_of_workers_that_load_for_15_s():
    behavior = {"health_status": 503}
    prefill = StandinWorker("prefill", Behavior(**behavior), port=free_port())
    decode = StandinWorker("decode", Behavior(**behavior), port=free_port())
    await prefill.start()
    await decode.start()
    config = RouterConfig(prefill=(WorkerSpec(prefill.url, "prefill", 8998),), decode=(WorkerSpec(decode.url, "decode"),),
                          **{**FAST, "health_check_interval_secs": 60.0})
    router, runner, port = await start_router(config)
    url = f"http://127.0.0.1:{port}/readiness"
    try:
        async with aiohttp.ClientSession() as client:
            await asyncio.sleep(LOAD_S)
            assert sorted(router.health.watched) == sorted([prefill.url, decode.url])  # still probed often
            prefill.behavior.health_status = decode.behavior.health_status = 200
            t_up = time.monotonic()
            while True:
                async with client.get(url) as r:
                    if r.status == 200:
                        break
                assert time.monotonic() - t_up < 3 * STARTUP_PROBE_S, "not ready within the probe interval"
                await asyncio.sleep(0.02)
            lag = time.monotonic() - t_up
            assert lag <= STARTUP_PROBE_S + 0.3, lag  # one probe gap and the probe itself
    finally:
        await runner.cleanup()
        await prefill.close()
        await decode.close()
