"""Start and stop an engine server: the scheduler ranks, then the HTTP API.

``run_server(config)`` is what ``pdserve serve`` runs. It spawns one scheduler
process per DP rank and TP rank (the cores split between them: each pinned to
its own share when there are enough, else torch threads split), waits until
every rank is ready, serves HTTP until SIGTERM/SIGINT, and on the way out stops
the ranks (SIGKILL: they ignore SIGTERM, see ``stop_ranks``) so no child is
left behind. If any process of a DP rank dies while serving, /health turns 503, the
requests in flight end with 503 naming the dead rank (DP and TP), and the
server exits with status 1, stopping the dead rank's TP siblings too.

With ``--nnodes N`` one DP rank's TP processes span N nodes: node 0 runs the
HTTP server and the first TP ranks, each other node (``--node-rank k``) only its
share of TP ranks, and exits when one of them dies or on SIGTERM. Under DP
attention the N nodes hold consecutive shares of the world's ranks (whole
attention groups per node, or whole nodes per group); the ranks off node 0 reach
its front end over the rank channel (``RemoteRanks``, at ``--dist-init-addr``'s
port + 1), and a node > 0 reports its dead rank there before it exits.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import multiprocessing as mp
import os
import signal
import time

import uvloop

import pdserve.engine.env as env
from pdserve.engine.http_site import serve_limited
from pdserve.entrypoints.cluster import free_port, split_cpus
from pdserve.entrypoints.loops import rank_loop_builder
from pdserve.engine.frontend.drain import Drain
from pdserve.engine.frontend.http_server import build_app
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.rank_transport import RemoteRanks, ZmqTransport
from pdserve.engine.sched.scheduler_process import RankSpec, run_scheduler_process
from pdserve.engine.server_config import ServerConfig
from pdserve.engine.frontend.tokenizer_manager import RankFailed, TokenizerManager

logger = logging.getLogger("pdserve.server")

RANK_STOP_GRACE = 3.0  # seconds a rank killed at stop gets to be gone
# seconds ranks get, on SIGUSR1 at stop, to send their storage tier's queued puts before SIGKILL
RANK_FLUSH_GRACE = 11.0  # the storage worker's CLOSE_FLUSH_S and a second
MONITOR_INTERVAL = 0.2
DEATH_DRAIN = 1.0  # seconds for 503s to reach clients before the server exits
REPORT_LINGER = 2.0  # seconds a node > 0 tries to tell node 0 that one of its ranks died


async def start_bootstrap_server(config: ServerConfig, metrics: ServerMetrics):
    """In prefill mode, start the bootstrap server on the running event loop and return it (its
    ``stop()`` is a coroutine); None in the other modes. The ranks register as they start; the
    server and the offline ``Engine`` both start it here."""
    if config.disaggregation_mode != "prefill":
        return None
    from pdserve.kvtransfer.bootstrap_server import BootstrapServer

    bootstrap = BootstrapServer(
        # a DP rank's processes register: under DP attention one per attention group
        config.host, config.kv_transfer.bootstrap_port, dp_size=config.dp_size, tp_size=config.attn_tp_size,
        auth=config.kv_transfer.frame_auth("bootstrap"),
        on_refused=metrics.bootstrap_auth_refused.inc,
        limits=config.http_limits, read_timeout=config.http_read_timeout,
    )
    await bootstrap.start()
    logger.info("bootstrap server on %s:%d", config.host, bootstrap.port)
    return bootstrap


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_processes(config: ServerConfig) -> int:
    return len(config.local_ranks())


def threads_per_rank(config: ServerConfig) -> int:
    if config.engine.num_threads:
        return config.engine.num_threads
    if env.PDSERVE_NUM_THREADS:
        return env.PDSERVE_NUM_THREADS
    return max(1, cpu_count() // local_processes(config))


def plan_ranks(config: ServerConfig) -> list[RankSpec]:
    """The scheduler processes of this node, DP-major. Each gets its own share of this process's
    cores when there are at least as many cores as processes (a TP rank's OpenMP threads then
    never wait on a sibling's); with fewer they share and only the thread count is split."""
    ranks = config.local_ranks()
    n = len(ranks)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    shares: list[tuple[int, ...] | None] = split_cpus(cpus, n) if 1 < n <= len(cpus) else [None] * n
    explicit = config.engine.num_threads or env.PDSERVE_NUM_THREADS
    specs = []
    shared = (config.dist_init_addr or f"127.0.0.1:{free_port()}") if config.enable_dp_attention else ""
    for i, (r, t) in enumerate(ranks):
        if config.enable_dp_attention:  # one world of every DP rank: their dense layers are split over it
            addr = shared
        elif config.tp_size == 1:
            addr = ""
        elif config.dist_init_addr is not None:
            host, _, port = config.dist_init_addr.rpartition(":")
            addr = f"{host}:{int(port) + r}"
        else:
            addr = f"127.0.0.1:{free_port()}" if t == 0 else specs[-1].dist_init_addr
        threads = explicit or (len(shares[i]) if shares[i] else threads_per_rank(config))
        specs.append(RankSpec(r, t, threads, shares[i], addr, config.rank_device(r, t)))
    return specs


def rank_addrs(config: ServerConfig, transport: ZmqTransport | None, dp_rank: int, tp_rank: int
               ) -> tuple[str | None, str | None]:
    """``(in_addr, out_addr)`` of one scheduler process (``run_scheduler_process``): node 0's ipc
    sockets for a rank whose DP rank's leader is on node 0; node 0's rank channel (TCP) for any
    other rank under DP attention across nodes; nothing for a node > 0 of multi-node TP, whose
    ranks follow node 0's leader and send nothing (``transport`` None: a node > 0)."""
    channel = config.rank_channel_addr
    if channel is not None and (transport is None or transport.rank_in_addrs[dp_rank] is None):
        return (channel if tp_rank == 0 else None), channel
    if transport is None:
        return None, None
    return (transport.rank_in_addrs[dp_rank] if tp_rank == 0 else None), transport.out_addr


def remote_ranks(config: ServerConfig) -> RemoteRanks | None:
    """Node 0's side of the rank channel: the DP ranks led from another node and every rank off
    node 0 (DP attention across nodes); None otherwise."""
    if config.rank_channel_addr is None:
        return None
    everyone = [(d, t) for d in range(config.dp_size) for t in range(config.attn_tp_size)]
    return RemoteRanks(config.rank_channel_addr, {(d, t) for d, t in everyone if config.node_of(d, t) > 0},
                       config.rank_channel_auth())


def spawn_ranks(config: ServerConfig, transport: ZmqTransport | None) -> dict[tuple[int, int], mp.Process]:
    """Start this node's scheduler processes, keyed by (dp_rank, tp_rank). ``transport`` None: a node > 0."""
    ctx = mp.get_context("spawn")
    build_loop = rank_loop_builder(config.disaggregation_mode)
    procs = {}
    for spec in plan_ranks(config):
        p = ctx.Process(
            target=run_scheduler_process,
            # every TP rank sends its own RankMetrics (its KV manager moves its own heads)
            args=(config, spec, *rank_addrs(config, transport, spec.dp_rank, spec.tp_rank), os.getpid(),
                  build_loop),
            name=f"pdserve-{spec.name}",
            daemon=True,
        )
        p.start()
        procs[(spec.dp_rank, spec.tp_rank)] = p
    return procs


def dead_rank_reason(config: ServerConfig, procs: dict[tuple[int, int], mp.Process]) -> str | None:
    """Which scheduler processes have exited, named by DP (and TP) rank; None while all run."""
    dead = [(r, t, p.exitcode) for (r, t), p in procs.items() if not p.is_alive()]
    if not dead:
        return None
    if config.tp_size == 1:
        names = [f"DP rank {r} exited with code {code}" for r, _, code in dead]
    else:
        names = [f"DP rank {r} TP rank {t} exited with code {code}" for r, t, code in dead]
    return "scheduler process of " + "; ".join(names)


async def watch_ranks(config: ServerConfig, procs: dict[tuple[int, int], mp.Process], tm: TokenizerManager,
                      remote: RemoteRanks | None = None) -> str:
    """Wait until a scheduler process exits, here or (``remote``: its node's server said so over
    the rank channel) on another node; then end every request in flight with an error naming
    the dead rank (and refuse new ones), and return that reason. The first cause stands: the
    ranks that fail after it, their peer gone, do not rename it."""
    while (reason := dead_rank_reason(config, procs) or (remote and remote.failure)) is None:
        await asyncio.sleep(MONITOR_INTERVAL)
    logger.error("%s; failing requests in flight", reason)
    if remote is None or remote.failure is None or tm.dead_reason is None:
        tm.fail_all(reason)
    return reason


def stop_ranks(procs: list[mp.Process]) -> None:
    """SIGUSR1 every process, wait up to RANK_FLUSH_GRACE for them to exit, SIGKILL the rest and wait
    up to RANK_STOP_GRACE for each to be gone.

    Ranks ignore SIGTERM (so that a SIGTERM to the whole process group leaves them serving this
    process's drain). On SIGUSR1 a rank sends its storage tier's queued puts (the storage worker's
    bounded flush) and exits at once; a rank without a storage tier exits at once. Nothing else
    in a rank is worth a clean exit once this process stops.
    """
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    deadline = time.monotonic() + RANK_FLUSH_GRACE
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    deadline = time.monotonic() + RANK_STOP_GRACE
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


async def serve(config: ServerConfig) -> int:
    from pdserve.engine.text.tokenizer import load_tokenizer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    drain: Drain | None = None  # set once serving: SIGTERM then drains (engine/frontend/drain.py)
    drain_tasks: list[asyncio.Task] = []  # the loop keeps only weak references to tasks

    def on_signal(signame: str) -> None:
        if signame == "SIGTERM" and drain is not None and drain.begin():
            logger.info("SIGTERM received: draining (up to %gs), then shutting down", drain.timeout)
            drain_tasks.append(loop.create_task(drain.run(tm.fail_all)))
            drain_tasks[-1].add_done_callback(lambda _: stop.set())
            return
        logger.info("%s received: shutting down", signame)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)

    metrics = ServerMetrics(config.dp_size, config.model_name, config.enable_dp_attention)
    tm = None
    bootstrap = None
    procs: dict[tuple[int, int], mp.Process] = {}
    runner = None
    try:
        await loop.run_in_executor(None, check_model, config)
        if config.node_rank > 0:
            return await serve_node(config, stop)
        tokenizer = None
        # the tokenizer is needed before the ranks are (they load the model, which takes longer)
        transport = ZmqTransport(config.dp_size, remote_ranks(config))
        tm = TokenizerManager(config, None, metrics, transport)
        # prefill mode: decode ranks find this server's prefill ranks here (and every node's
        # prefill ranks register here, at --dist-init-addr's host when nnodes > 1)
        _check_bootstrap_host(config)
        bootstrap = await start_bootstrap_server(config, metrics)
        procs = spawn_ranks(config, transport)
        e = config.engine
        tm.tokenizer = tokenizer = await loop.run_in_executor(None, load_tokenizer, e.model_path, e.tokenizer_path,
                                                              e.chat_template)
        alive = lambda: all(p.is_alive() for p in procs.values())  # noqa: E731
        ready = asyncio.ensure_future(tm.wait_ready(config.startup_timeout, alive))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 0
        stopped.cancel()
        ready.result()  # raises RankFailed

        drain = Drain(config.graceful_shutdown_timeout, lambda: sum(tm.inflight))
        app = build_app(tm, config, metrics, drain)
        runner = await serve_limited(app, config.host, config.port, config.http_limits, handler_cancellation=True,
                                     access_log=None, shutdown_timeout=1.0)
        port = runner.addresses[0][1] if runner.addresses else config.port
        logger.info(
            "pdserve serving %s on http://%s:%d (dp_size=%d, tp_size=%d, %d threads per rank, tokenizer %s)",
            config.model_name, config.host, port, config.dp_size, config.tp_size, threads_per_rank(config),
            type(tokenizer).__name__,
        )

        async def monitor() -> None:
            nonlocal exit_code
            await watch_ranks(config, procs, tm, transport.remote)
            logger.error("exiting after the death of a scheduler process")
            exit_code = 1
            await asyncio.sleep(DEATH_DRAIN)
            stop.set()

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
        await loop.run_in_executor(None, stop_ranks, list(procs.values()))
        if bootstrap is not None:
            await bootstrap.stop()
        if tm is not None:
            tm.close()
        logger.info("pdserve stopped")


def check_model(config: ServerConfig) -> None:
    """Refuse, before any rank loads weights, what the real model (its config.json or GGUF header)
    cannot serve: a quantized checkpoint, a TP size its heads cannot be split by, a context_length
    past its own, a LoRA adapter of --lora-paths that does not fit it."""
    from pdserve.engine.model_executor.model_loader import load_arch

    arch = load_arch(config.engine.model_path)
    arch.check_parallel(config.attn_tp_size, config.tp_size)  # heads within a group, MLP over all
    if config.engine.context_length is not None:
        arch.with_context_length(config.engine.context_length)
    draft = config.engine.speculative_draft_model_path
    if draft is not None and config.disaggregation_mode != "prefill":  # a prefill server ignores it
        check_draft_model(arch, draft, config.tp_size)
    if config.engine.enable_lora:
        from pdserve.engine.model_executor.lora_manager import read_adapters

        read_adapters(config.engine, arch.num_layers)  # a bad adapter names itself here, not in a rank


def check_draft_model(target, path: str, tp_size: int) -> None:
    """--speculative-draft-model-path from its header, before any rank loads weights: a model that
    loads, splits over ``tp_size`` ranks and has the target's vocabulary size (the ranks compare the
    tokenizers); a ValueError naming the flag otherwise (else a bad path read as the target's)."""
    from pdserve.engine.model_executor.model_loader import load_arch

    try:
        arch = load_arch(path)
        arch.check_tp_size(tp_size)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"speculative_draft_model_path {path!r} cannot serve as the draft: {e}") from None
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_draft_model_path {path!r} has a vocabulary of {arch.vocab_size} tokens, "
                         f"the target model {target.vocab_size}: a draft model must share the target's tokenizer")


def _check_bootstrap_host(config: ServerConfig) -> None:
    """A multi-node prefill server's ranks register at --dist-init-addr's host: node 0's bootstrap
    server, which listens on --host, must be reachable there."""
    if config.disaggregation_mode != "prefill" or config.nnodes == 1:
        return
    where = config.bootstrap_host
    try:  # two literal addresses that differ (a DNS name, as in Kubernetes, resolves to the pod IP)
        differ = ipaddress.ip_address(config.host) != ipaddress.ip_address(where)
    except ValueError:
        differ = False
    if differ and config.host not in ("0.0.0.0", "::"):
        raise ValueError(f"--nnodes {config.nnodes}: every node's prefill ranks register with the bootstrap "
                         f"server at --dist-init-addr's host {where}, but node 0 listens on --host "
                         f"{config.host}; give --host {where} or 0.0.0.0")


async def serve_node(config: ServerConfig, stop: asyncio.Event) -> int:
    """A node > 0: run this node's ranks (its share of one multi-node DP rank's TP ranks, or
    under DP attention its attention groups' ranks) until one dies or SIGTERM. Under DP attention
    a death is told to node 0's front end (``report_death``), which ends the requests in flight
    naming it; the node's ranks fail their next collective once node 0 is gone, so this node
    exits then too."""
    procs = spawn_ranks(config, None)
    logger.info("node %d of %d: ranks (DP, TP) %s joining %s", config.node_rank, config.nnodes,
                config.local_ranks(), config.dist_init_addr)
    try:
        while not stop.is_set():
            reason = dead_rank_reason(config, procs)
            if reason is not None:
                logger.error("%s; stopping this node", reason)
                if config.rank_channel_addr is not None:
                    await asyncio.get_running_loop().run_in_executor(None, report_death, config, procs, reason)
                return 1
            try:
                await asyncio.wait_for(stop.wait(), MONITOR_INTERVAL)
            except asyncio.TimeoutError:
                pass
        return 0
    finally:
        await asyncio.get_running_loop().run_in_executor(None, stop_ranks, list(procs.values()))


def report_death(config: ServerConfig, procs: dict[tuple[int, int], mp.Process], reason: str) -> None:
    """Tell node 0's front end, over the rank channel, that a rank of this node died: a
    ``SchedulerError`` of its DP rank naming it, sealed from ``node{k}`` with the shared key
    (when one is configured). Waits up to REPORT_LINGER for it to leave (node 0 may be gone)."""
    import msgspec
    import zmq

    from pdserve.engine.messages import SchedulerError
    from pdserve.engine.sched.rank_sockets import dealer

    dp_rank = next(r for (r, _), p in sorted(procs.items()) if not p.is_alive())
    payload = msgspec.msgpack.encode([SchedulerError(dp_rank=dp_rank, message=reason)])
    auth = config.rank_channel_auth()
    if auth is not None:
        payload = auth.seal(payload, f"node{config.node_rank}", config.rank_channel_addr)
    ctx = zmq.Context()
    sock = dealer(ctx, config.rank_channel_addr)
    sock.setsockopt(zmq.LINGER, int(REPORT_LINGER * 1000))
    sock.send(payload)
    sock.close()
    ctx.term()  # returns once the frame is sent, or after the linger


def run_server(config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return uvloop.run(serve(config))
