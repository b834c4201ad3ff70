"""The ``pdserve planner`` process: one asyncio loop that every ``adjustment_interval`` scrapes the
router (entrypoints/planner/scrape.py), steps the SLA planner (entrypoints/planner/sla_planner.py), logs the
decision with its inputs as one JSON line, exposes it on its own ``/metrics``, and hands the counts
to the connector. A failed or nonsense scrape holds the last decision (counted in
``pdserve_planner_held_decisions_total``); the connector is polled every second for its
background work (servers starting, drains finishing, retries).

At start the profiles are checked against the servers in use (each role's first worker's
``/get_server_info``): a profile of another model or configuration is refused, naming the
difference.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import msgspec
from aiohttp import web

from pdserve.engine.http_site import serve_limited
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.connector import Connector, connector_class
from pdserve.entrypoints.planner.planner_config import PlannerConfig
from pdserve.entrypoints.planner.planner_metrics import PlannerMetrics
from pdserve.entrypoints.planner.profiler import describe
from pdserve.entrypoints.planner.scaling import Counts, Limits, Slo
from pdserve.entrypoints.planner.scrape import ScrapeError, observe, scrape
from pdserve.entrypoints.planner.sla_planner import SlaPlanner, Step

log = logging.getLogger("pdserve.planner")
POLL_S = 1.0
KEEP_STEPS = 100  # decisions kept for GET /decisions


def _get_json(url: str, timeout: float, api_key: str | None):
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


def check_profiles(config: PlannerConfig, profiles: dict[str, prof.Profile]) -> list[str]:
    """Refuse (ProfileMismatch) a profile whose servers differ from the router's workers of its role;
    returns the roles that could not be checked (no worker answered)."""
    unchecked = []
    try:
        listing = _get_json(config.router + "/workers", config.scrape_timeout, config.api_key)
    except (OSError, ValueError):
        return list(profiles)
    for role, profile in profiles.items():
        info = None
        for w in listing.get(role) or []:
            try:
                info = _get_json(w["url"] + "/get_server_info", config.scrape_timeout, config.api_key)
                break
            except (OSError, ValueError, KeyError, TypeError):
                continue
        if info is None:
            unchecked.append(role)
            continue
        path = config.prefill_profile_path if role == "prefill" else config.decode_profile_path
        prof.check_matches(profile, describe(info), f"the {role} profile {path}")
    return unchecked


def step_json(step: Step, target: Counts) -> str:
    return json.dumps({"time": round(time.time(), 3), "held": step.held, "why_held": step.why_held,
                       "observation": msgspec.to_builtins(step.observation),
                       "predicted": msgspec.to_builtins(step.predicted),
                       "corrections": [round(c, 4) for c in step.corrections],
                       "needed": msgspec.to_builtins(step.decision.needed),
                       "target": msgspec.to_builtins(target), "reasons": list(step.decision.reasons)})


class PlannerProcess:
    def __init__(self, config: PlannerConfig, connector: Connector | None = None):
        self.config = config
        self.profiles = {"prefill": prof.load(config.prefill_profile_path),
                         "decode": prof.load(config.decode_profile_path)}
        self.metrics = PlannerMetrics()
        self.connector = connector
        self.planner: SlaPlanner | None = None
        self.steps: list[str] = []
        self.target: Counts | None = None

    def start(self) -> None:
        if not self.config.skip_profile_check:
            for role in check_profiles(self.config, self.profiles):
                log.warning("no %s worker answered /get_server_info: the %s profile is not checked", role, role)
        if self.connector is None:
            self.connector = connector_class(self.config.connector).from_config(self.config, self.metrics)
        c = self.config
        limits = Limits(min_prefill=c.min_prefill, max_prefill=c.max_prefill, min_decode=c.min_decode,
                        max_decode=c.max_decode, budget=c.budget,
                        prefill_cost=float(self.profiles["prefill"].server.tp_size),
                        decode_cost=float(self.profiles["decode"].server.tp_size), cooldown_s=c.cooldown,
                        max_utilization=c.max_utilization)
        self.planner = SlaPlanner(self.profiles["prefill"], self.profiles["decode"],
                                  Slo(c.ttft_slo, c.itl_slo, c.slo_quantile), limits, self.connector.current(),
                                  predictor=c.predictor, window=c.predictor_window, now=time.monotonic(),
                                  correct=c.correction)
        self.target = self.connector.current()

    def decide(self, obs) -> Step:
        """One interval: step the planner, log, record, hand the counts to the connector."""
        step = self.planner.step(time.monotonic(), obs, self.connector.current())
        counts = step.decision.counts
        previous = (self.target.prefill, self.target.decode) if self.target is not None else None
        self.metrics.record(step, previous)
        if not step.held:
            self.target = counts
            self.connector.apply(counts)
        line = step_json(step, self.target or counts)
        self.steps = (self.steps + [line])[-KEEP_STEPS:]
        log.info("decision %s", line)
        self.metrics.set_servers(self.connector.status())
        return step

    async def run(self, stop: asyncio.Event) -> None:
        c = self.config
        prev = None
        next_decision = time.monotonic() + c.adjustment_interval
        try:
            prev = await asyncio.to_thread(scrape, c.router, c.scrape_timeout, c.api_key)
        except ScrapeError as e:
            log.warning("first scrape failed: %s", e)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=POLL_S)
                break
            except asyncio.TimeoutError:
                pass
            await asyncio.to_thread(self.connector.poll)
            self.metrics.set_servers(self.connector.status())
            if time.monotonic() < next_decision:
                continue
            next_decision += c.adjustment_interval
            try:
                cur = await asyncio.to_thread(scrape, c.router, c.scrape_timeout, c.api_key)
            except ScrapeError as e:
                log.warning("scrape failed: %s", e)
                cur = None
            obs = observe(prev, cur) if prev is not None and cur is not None else None
            if cur is not None:
                prev = cur
            await asyncio.to_thread(self.decide, obs)

    def make_app(self) -> web.Application:
        app = web.Application()

        async def metrics(_):
            return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

        async def health(_):
            return web.json_response({"status": "ok"})

        async def decisions(_):
            return web.Response(text="[" + ",".join(self.steps) + "]", content_type="application/json")

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        app.router.add_get("/decisions", decisions)
        return app


async def serve_planner(config: PlannerConfig, stop: asyncio.Event | None = None,
                        connector: Connector | None = None, on_ready=None) -> None:
    """Run the planner until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None)."""
    process = PlannerProcess(config, connector)
    await asyncio.to_thread(process.start)
    runner = await serve_limited(process.make_app(), config.host, config.port, config.http_limits, access_log=None)
    port = runner.addresses[0][1]
    log.info("planner on http://%s:%d/metrics; router %s; connector %s", config.host, port, config.router,
             config.connector)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(process, port)
    try:
        await process.run(stop)
    finally:
        await asyncio.to_thread(process.connector.close)
        await runner.cleanup()
