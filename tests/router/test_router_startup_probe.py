"""A worker that was never healthy is probed at a fixed 0.5 s (``health.STARTUP_PROBE_S``) until
``--worker-startup-timeout-secs``, however long it takes to load: a router started with workers that
answer after 15 s is ready within that interval of them (a doubling backoff would leave a gap of up
to 16 s by then). Backoff is only for workers that were healthy and failed.

What made the workers ready is asserted by the delays the probes drew and by the probe kind the
health checker logs with each change of rotation, not by a time bound."""

import asyncio
import logging

import aiohttp
import pytest

from pdserve.entrypoints.procs import free_port
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.server import start_router
from pdserve.router.workers import health
from pdserve.router.workers.health import STARTUP_PROBE_S, startup_probe_delays
from pdserve.router.workers.worker_registry import WorkerRegistry
from support.health_log import rotation_changes
from support.standin_worker import Behavior, StandinWorker

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
async def test_router_is_ready_within_the_probe_interval_of_workers_that_load_for_15_s(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=health.log.name)
    waits = {"startup": [], "backoff": []}  # the delays the watching probes drew, by kind

    def recorded(kind, gen):
        def wrapper(*args):
            for d in gen(*args):
                waits[kind].append(d)
                yield d
        return wrapper

    monkeypatch.setattr(health, "startup_probe_delays", recorded("startup", health.startup_probe_delays))
    monkeypatch.setattr(health, "probe_delays", recorded("backoff", health.probe_delays))
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
            # every wait between the probes of the loading workers was the fixed startup gap, none a
            # doubled one: one probe per gap, so each worker answered one more probe than its waits
            assert waits["backoff"] == [] and set(waits["startup"]) == {STARTUP_PROBE_S}
            assert prefill.health_checks + decode.health_checks >= len(waits["startup"])
            prefill.behavior.health_status = decode.behavior.health_status = 200
            while True:
                async with client.get(url) as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.02)
            # the watching startup probes saw the change, one each, before any 60 s interval probe
            assert sorted(rotation_changes(caplog.records)) == [("decode", "back in rotation", "startup"),
                                                                ("prefill", "back in rotation", "startup")]
            assert router.health.watched == []  # healthy: back to the interval
            assert waits["backoff"] == []
    finally:
        await runner.cleanup()
        await prefill.close()
        await decode.close()
