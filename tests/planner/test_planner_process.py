"""The planner process's parts on real sockets: the scrape of real router and server metrics, the
local connector against a real router (its servers: stand-in workers started as processes), and
the process's decisions with the virtual connector (hold on a failed scrape, refuse a profile of
other servers, its own /metrics)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.connector import VirtualConnector
from pdserve.entrypoints.planner.local_connector import LocalConnector
from pdserve.entrypoints.planner.planner_config import PlannerConfig
from pdserve.entrypoints.planner.planner_process import PlannerProcess, check_profiles
from pdserve.entrypoints.planner.router_api import RouterApi
from pdserve.entrypoints.planner.scaling import Counts
from pdserve.entrypoints.planner.scrape import Snapshot, observe, parse_router, parse_worker, scrape
from pdserve.entrypoints.planner.sla_planner import Observation
from pdserve.entrypoints.procs import group_pids
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.metrics import RouterMetrics
from pdserve.router.server import start_router
from pdserve.router.workers.worker_registry import WorkerRegistry

from planner_synthetic import synthetic_profile

ROUTER_TESTS = Path(__file__).resolve().parents[1] / "router"
sys.path.insert(0, str(ROUTER_TESTS))
from standin_worker import Behavior, StandinWorker  # noqa: E402

FAST = dict(health_check_interval_secs=3600.0, health_check_timeout_secs=1.0, request_timeout_secs=10.0,
            host="127.0.0.1", port=0)


def test_parse_real_metrics_and_observe():
    reg = WorkerRegistry()
    w = reg.add(WorkerSpec("http://d:1", "decode"), healthy=True)
    rm = RouterMetrics(reg)
    for _ in range(3):
        rm.requests.inc("/generate", "200")
        rm.ttft.observe(0.5)
    rm.requests.inc("/get_model_info", "200")  # not an inference route
    w.endpoints[0].load = 2
    fin, tsum, tcount, in_flight = parse_router(rm.render().decode())
    assert (fin, tsum, tcount, in_flight) == (3, 1.5, 3, {"http://d:1": 2})
    sm = ServerMetrics(1, "m")
    sm.on_finish("length", 100, 20, 0, 1.0)
    sm.tpot.observe(0.05)
    d = parse_worker(sm.render([None], [0]), "decode")
    assert (d.finished, d.prompt_tokens, d.generation_tokens, d.tpot_sum, d.tpot_count) == (1, 100, 20, 0.05, 1)
    prev = Snapshot(time=0.0, finished=10, ttft_sum=5.0, ttft_count=10, in_flight=4, serving={"prefill": 1, "decode": 2},
                    workers={"http://d:1": d})
    d2 = parse_worker((sm.on_finish("length", 300, 60, 0, 1.0), sm.tpot.observe(0.15), sm.render([None], [0]))[2],
                      "decode")
    cur = Snapshot(time=10.0, finished=20, ttft_sum=15.0, ttft_count=20, in_flight=6, serving={"prefill": 1, "decode": 2},
                   workers={"http://d:1": d2})
    obs = observe(prev, cur)
    # arrivals = 10 finished + 2 more in flight, over 10 s; TTFT = 10 s / 10; ITL 0.15 s, output 60
    assert obs.rate == pytest.approx(1.2) and obs.ttft_s == pytest.approx(1.0)
    assert obs.itl_s == pytest.approx(0.15) and obs.output_len == pytest.approx(60)
    assert obs.decode_servers == 2 and obs.input_len is None
    # a router that restarted: its counter went down; the planner refuses the negative rate
    assert observe(cur, Snapshot(time=20.0, finished=1, ttft_sum=0, ttft_count=0, in_flight=0, serving={},
                                 workers={})).rate < 0


async def _router(n_prefill=1, n_decode=1, behavior=None):
    workers = []
    for role, n in (("prefill", n_prefill), ("decode", n_decode)):
        for _ in range(n):
            w = StandinWorker(role, behavior or Behavior())
            await w.start()
            workers.append(w)
    cfg = RouterConfig(prefill=tuple(WorkerSpec(w.url, "prefill", 8998) for w in workers if w.role == "prefill"),
                       decode=tuple(WorkerSpec(w.url, "decode") for w in workers if w.role == "decode"), **FAST)
    router, runner, port = await start_router(cfg)
    return router, runner, workers, f"http://127.0.0.1:{port}"


async def test_local_connector_starts_registers_drains_and_stops(tmp_path):
    router, runner, workers, url = await _router()
    standin = str(ROUTER_TESTS / "standin_worker.py")

    def argv(role, host, port, bootstrap):
        return [sys.executable, standin, "--role", role, "--host", host, "--port", str(port)]

    conn = await asyncio.to_thread(LocalConnector, RouterApi(url), argv, log_dir=str(tmp_path), drain_timeout=5.0)
    try:
        assert conn.external == {"prefill": 1, "decode": 1} and conn.current() == Counts(1, 1)
        await asyncio.to_thread(conn.apply, Counts(1, 2))
        assert conn.current() == Counts(1, 2)  # a server starting counts (it was asked for)
        deadline = time.monotonic() + 60
        while conn.status()["decode"]["ready"] < 1:
            assert time.monotonic() < deadline, conn.status()
            await asyncio.to_thread(conn.poll)
            await asyncio.sleep(0.2)
        (mine,) = [s for s in conn.servers if s.state == "ready"]
        assert router.registry.get(mine.url).role == "decode"
        # it takes requests through the router
        await asyncio.sleep(0)
        status, _ = await _post(url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert status == 200
        # scale down: drained at the router, removed, its process group gone; the cluster's own kept
        await asyncio.to_thread(conn.apply, Counts(1, 1))
        await asyncio.to_thread(conn.close)
        assert mine.state == "stopped" and router.registry.get(mine.url) is None
        assert not group_pids(mine.proc.pid)
        assert len(router.registry.workers("decode")) == 1
        # lowering below the cluster's own servers keeps them
        await asyncio.to_thread(conn.apply, Counts(1, 0))
        assert conn.current() == Counts(1, 1)
    finally:
        for s in conn.servers:
            if s.proc.poll() is None:
                s.proc.kill()
        await runner.cleanup()
        for w in workers:
            await w.close()


async def _post(url, body):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.read()


async def test_process_holds_on_bad_scrapes_and_refuses_other_profiles(tmp_path):
    router, runner, workers, url = await _router()
    path = str(tmp_path / "p.json")
    prof.save(synthetic_profile(), path)
    try:
        cfg = PlannerConfig(router=url, profile=path, ttft_slo=2.0, itl_slo=0.1, predictor="constant")
        # the stand-ins serve "standin-model"; the profile is of "synthetic"
        with pytest.raises(prof.ProfileMismatch, match="model: 'synthetic' != 'standin-model'"):
            await asyncio.to_thread(check_profiles, cfg, {"prefill": synthetic_profile(),
                                                          "decode": synthetic_profile()})
        cfg = PlannerConfig(router=url, profile=path, ttft_slo=2.0, itl_slo=0.1, predictor="constant",
                            skip_profile_check=True)
        process = PlannerProcess(cfg, VirtualConnector(Counts(1, 1)))
        await asyncio.to_thread(process.start)
        snap = await asyncio.to_thread(scrape, url)
        assert snap.serving == {"prefill": 1, "decode": 1}
        step = process.decide(Observation(interval_s=10, rate=2.0, input_len=1000, output_len=200))
        assert step.decision.counts == Counts(4, 8) and process.connector.current() == Counts(4, 8)
        for bad in (None, Observation(interval_s=10, rate=float("inf"))):
            held = process.decide(bad)
            assert held.held and process.connector.current() == Counts(4, 8)
        text = process.metrics.render().decode()
        assert 'pdserve_planner_held_decisions_total{reason="scrape_failed"} 1.0' in text
        assert 'pdserve_planner_held_decisions_total{reason="nonsense"} 1.0' in text
        assert 'pdserve_planner_target_servers{role="decode"} 8.0' in text
        assert 'pdserve_planner_scale_events_total{role="decode",direction="up"} 1.0' in text
        assert '"held": true' in process.steps[-1] and '"why_held": "rate is inf"' in process.steps[-1]
    finally:
        await runner.cleanup()
        for w in workers:
            await w.close()
