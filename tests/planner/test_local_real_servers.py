"""The planner with the local connector on real servers (issue 32): a cluster of one prefill and
one decode server and the router (engine/entrypoints/cluster.py, as ``pdserve launch`` starts it) and the
planner process beside it. Under a rising load the planner starts a second decode server, which
the router sends requests to; when the load stops it drains and stops it; no request fails across
both transitions. One test: every server start here is a model load.

The profile is the servers' own description (so the planner's check passes) with round numbers
chosen so that the low rate needs one decode server and the high rate two."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp
import pytest

from pdserve.engine.entrypoints.cluster import Cluster, LaunchConfig
from pdserve.engine.planner import profile as prof
from pdserve.engine.planner.perf_model import DecodeModel, PrefillModel
from pdserve.engine.planner.planner_config import PlannerConfig
from pdserve.engine.planner.planner_process import serve_planner
from pdserve.engine.planner.profiler import describe
from pdserve.engine.planner.scaling import Counts, Limits, Load, Slo, decide
from pdserve.engine.entrypoints.procs import get_json, group_pids

SERVE = ("--max-total-tokens", "2048", "--dtype", "float32")
TOKENS = 12
SLO = Slo(ttft_s=100.0, itl_s=0.1)
LOW, HIGH = 0.3, 3.0  # req/s


def _profile(server: prof.ServerDescription) -> prof.Profile:
    # decode ITL 0.02 + 0.02 b: at most 4 sequences per server meet 0.1 s
    return prof.new_profile(server, [prof.PrefillPoint(16, 0.05), prof.PrefillPoint(1024, 0.5)],
                            [prof.DecodePoint(b, c, 0.02 + 0.02 * b) for c in (16, 1024) for b in (1, 4, 16)])


async def _client(session: aiohttp.ClientSession, url: str, results: list) -> None:
    # a prompt of its own: the router's cache-aware policy would send one shared prompt to the
    # decode server that holds its prefix, never to the new one
    body = {"text": f"{secrets.token_hex(6)} count from one to twenty:", "stream": True,
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}
    try:
        async with session.post(url + "/generate", json=body) as r:
            text = (await r.read()).decode()
            ok = r.status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            results.append((r.status, ok, "" if ok else text[-300:]))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        results.append((0, False, repr(e)))


@pytest.mark.timeout(900)
async def test_planner_adds_a_decode_server_under_load_and_drains_it_after(tmp_path):
    cluster = Cluster(LaunchConfig(prefill=1, decode=1, port=0, engine_args=SERVE, log_dir=str(tmp_path),
                                   startup_timeout=600))
    stop = asyncio.Event()
    planner_task = None
    try:
        cluster.start()
        assert await asyncio.to_thread(cluster.wait_ready)
        info = get_json(cluster.specs[1].url + "/get_server_info", timeout=10)
        profile = _profile(describe(info))
        path = str(tmp_path / "profile.json")
        prof.save(profile, path)
        limits = Limits(max_prefill=1, max_decode=2, cooldown_s=3)
        load = Load(LOW, 8, TOKENS)
        pm, dm = PrefillModel(profile), DecodeModel(profile)
        never = (1e9, 1e9)
        assert decide(pm, dm, load, SLO, limits, Counts(1, 1), never).counts == Counts(1, 1)
        assert decide(pm, dm, Load(HIGH, 8, TOKENS), SLO, limits, Counts(1, 1), never).counts == Counts(1, 2)
        config = PlannerConfig(router=cluster.url, profile=path, ttft_slo=SLO.ttft_s, itl_slo=SLO.itl_s,
                               adjustment_interval=2.0, predictor="constant", max_prefill=1, max_decode=2,
                               cooldown=3.0, connector="local", serve_args=SERVE, log_dir=str(tmp_path),
                               drain_timeout=60.0, transfer_backend=cluster.config.transfer_backend)
        ready = asyncio.get_running_loop().create_future()
        planner_task = asyncio.ensure_future(serve_planner(config, stop, on_ready=lambda p, port: ready.set_result(p)))
        process = await asyncio.wait_for(ready, 60)
        conn = process.connector
        results: list = []
        tasks = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def send(rate: float, until) -> None:
                while not until():
                    tasks.append(asyncio.ensure_future(_client(session, cluster.url, results)))
                    await asyncio.sleep(1 / rate)

            # rising load: low, then high until the new decode server has served requests
            t0 = time.monotonic()
            await send(LOW, lambda: time.monotonic() - t0 > 5)
            mine = []

            def served() -> bool:
                mine[:] = [s for s in conn.servers if s.state == "ready"]
                if not mine:
                    assert time.monotonic() - t0 < 600, f"no decode server added: {process.steps[-3:]}"
                    return False
                entry = get_json(cluster.url + "/workers", timeout=5) or {}
                listed = [w for w in entry.get("decode", []) if w["url"] == mine[0].url]
                return bool(listed) and (get_json(mine[0].url + "/metrics", timeout=5) is not None
                                         and _served(mine[0].url) >= 3)

            await send(HIGH, served)
            (new,) = mine
            assert new.role == "decode"
            # the load stops: the planner drains the new server and stops it once drained
            await asyncio.gather(*tasks)
            deadline = time.monotonic() + 300
            while new.state != "stopped":
                assert time.monotonic() < deadline, (new.state, process.steps[-3:])
                await asyncio.sleep(0.5)
        assert not group_pids(new.proc.pid)
        workers = get_json(cluster.url + "/workers", timeout=5)
        assert [w["url"] for w in workers["decode"]] == [cluster.specs[1].url]
        failed = [r for r in results if not r[1]]
        assert not failed and len(results) >= 10, failed[:3]
        decisions = [json.loads(s) for s in process.steps]
        assert any(d["target"]["decode"] == 2 for d in decisions)
        assert decisions[-1]["target"]["decode"] == 1
    finally:
        stop.set()
        if planner_task is not None:
            await asyncio.wait_for(planner_task, 120)
        cluster.stop()


def _served(url: str) -> float:
    """Sequences a server has finished (its pdserve_requests_finished_total)."""
    import urllib.request

    from pdserve.engine.planner.scrape import parse_worker

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return parse_worker(r.read().decode(), "decode").finished
