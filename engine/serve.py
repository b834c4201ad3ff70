"""Start and stop an engine server: the scheduler ranks, then the HTTP API.

``run_server(config)`` is what ``pdserve serve`` runs. It spawns one scheduler
process per DP rank (torch threads split between them), waits until every
rank is ready, serves HTTP until SIGTERM/SIGINT, and on the way out stops
the ranks (SIGTERM, then SIGKILL after a grace period) so no child is left
behind. If a rank dies while serving, /health turns 503, the requests in
flight end with 503, and the server exits with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import time

import uvloop
from aiohttp import web

import pdserve.engine.env as env
from pdserve.engine.frontend.http_server import build_app
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.rank_transport import ZmqTransport
from pdserve.engine.sched.scheduler_process import run_scheduler_process
from pdserve.engine.server_config import ServerConfig
from pdserve.engine.frontend.tokenizer_manager import RankFailed, TokenizerManager

logger = logging.getLogger("pdserve.server")

RANK_STOP_GRACE = 3.0  # seconds a rank gets after SIGTERM before SIGKILL
MONITOR_INTERVAL = 0.2
DEATH_DRAIN = 1.0  # seconds for 503s to reach clients before the server exits


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_rank(config: ServerConfig) -> int:
    if config.engine.num_threads:
        return config.engine.num_threads
    if env.PDSERVE_NUM_THREADS:
        return env.PDSERVE_NUM_THREADS
    return max(1, cpu_count() // config.dp_size)


def spawn_ranks(config: ServerConfig, transport: ZmqTransport) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    n = threads_per_rank(config)
    procs = []
    for r in range(config.dp_size):
        p = ctx.Process(
            target=run_scheduler_process,
            args=(config, r, transport.rank_in_addrs[r], transport.out_addr, os.getpid(), n),
            name=f"pdserve-dp{r}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs


def stop_ranks(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + RANK_STOP_GRACE
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


async def serve(config: ServerConfig) -> int:
    from pdserve.engine.model_executor.tokenizer import load_tokenizer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    def on_signal(signame: str) -> None:
        logger.info("%s received: shutting down", signame)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)

    metrics = ServerMetrics(config.dp_size, config.model_name)
    tm = None
    bootstrap = None
    procs: list[mp.Process] = []
    runner = None
    try:
        tokenizer = None
        # the tokenizer is needed before the ranks are (they load the model, which takes longer)
        transport = ZmqTransport(config.dp_size)
        tm = TokenizerManager(config, None, metrics, transport)
        if config.disaggregation_mode == "prefill":
            # decode ranks find this server's prefill ranks here; the ranks register as they start
            from pdserve.kvtransfer.bootstrap_server import BootstrapServer

            bootstrap = BootstrapServer(config.host, config.disaggregation_bootstrap_port, dp_size=config.dp_size)
            await bootstrap.start()
            logger.info("bootstrap server on %s:%d", config.host, bootstrap.port)
        procs = spawn_ranks(config, transport)
        tm.tokenizer = tokenizer = await loop.run_in_executor(None, load_tokenizer, config.engine.model_path)
        ready = asyncio.ensure_future(tm.wait_ready(config.startup_timeout, lambda: all(p.is_alive() for p in procs)))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 0
        stopped.cancel()
        ready.result()  # raises RankFailed

        app = build_app(tm, config, metrics)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.port
        logger.info(
            "pdserve serving %s on http://%s:%d (dp_size=%d, %d threads per rank, tokenizer %s)",
            config.model_name, config.host, port, config.dp_size, threads_per_rank(config), type(tokenizer).__name__,
        )

        async def monitor() -> None:
            nonlocal exit_code
            while not stop.is_set():
                for r, p in enumerate(procs):
                    if not p.is_alive():
                        reason = f"scheduler process of DP rank {r} exited with code {p.exitcode}"
                        logger.error("%s; failing requests in flight and exiting", reason)
                        tm.fail_all(reason)
                        exit_code = 1
                        await asyncio.sleep(DEATH_DRAIN)
                        stop.set()
                        return
                await asyncio.sleep(MONITOR_INTERVAL)

        monitor_task = loop.create_task(monitor())
        await stop.wait()
        monitor_task.cancel()
        if tm.dead_reason is None:
            tm.fail_all("server shutting down")
        return exit_code
    except (RankFailed, ValueError, OSError) as e:  # start-up failed: a rank, the tokenizer, the port
        logger.error("pdserve serve failed to start: %s", e)
        return 1
    finally:
        if runner is not None:
            try:
                await asyncio.wait_for(runner.cleanup(), 3.0)
            except asyncio.TimeoutError:
                logger.warning("HTTP server did not stop within 3 s")
        await loop.run_in_executor(None, stop_ranks, procs)
        if bootstrap is not None:
            await bootstrap.stop()
        if tm is not None:
            tm.close()
        logger.info("pdserve stopped")


def run_server(config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return uvloop.run(serve(config))
