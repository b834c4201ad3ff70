"""Entry function of one scheduler process: a DP rank, or one TP rank of it.

``run_scheduler_process`` sets the process up (dies with its parent through PR_SET_PDEATHSIG, so no
rank outlives a killed server; ignores the signals its parent handles; logs under the rank's tag;
pins its CPUs, ``rank_affinity.py``), builds the rank's loop with the builder it is given (the entry
points' table, ``entrypoints/loops.py``: ``SchedulerLoop`` in colocated mode, ``PrefillLoop`` or
``DecodeLoop`` in the PD modes), announces itself with ``SchedulerReady``, then runs the rank loop
(``rank_loop.serve_rank``) over the messages of the HTTP process, which arrive over ZMQ
(``rank_sockets.py``, where the TP broadcast lives). The offline Engine runs the same
``serve_rank`` on a thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import zmq

from pdserve.engine.messages import SchedulerError
from pdserve.engine.sched import rank_affinity, rank_sockets
from pdserve.engine.sched.loop_builder import LoopBuilder
from pdserve.engine.sched.rank_loop import ready_info, serve_rank
from pdserve.engine.server_config import ServerConfig

logger = logging.getLogger(__name__)

# A TP rank whose step fails (a dead peer surfaces as a collective error within a
# second) waits this long before exiting, so that the server's monitor, polling every
# 0.2 s, names the process that died first rather than the survivor.
PEER_FAILURE_GRACE = 3.0


@dataclass(frozen=True)
class RankSpec:
    """Where one scheduler process sits and what it runs on."""

    dp_rank: int
    tp_rank: int = 0
    num_threads: int = 1
    cpus: tuple[int, ...] | None = None  # CPU affinity of this process; None: inherit the server's
    # host:port of this DP rank's TP group (TP rank 0 listens), or under DP attention the world of
    # every DP rank's attention group (DP rank 0's TP rank 0 listens); unused at TP 1
    dist_init_addr: str = ""
    device: str = "cpu"  # this rank's device (cuda:N on CUDA)

    @property
    def name(self) -> str:
        return f"dp{self.dp_rank}-tp{self.tp_rank}"


def _die_with_parent(name: str) -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # shows in ps/top and /proc/PID/comm, so an operator (or a test) can tell the ranks apart
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(f"pdserve-{name}".encode()[:15]))


def run_scheduler_process(config: ServerConfig, rank: RankSpec, in_addr: str | None, out_addr: str | None,
                          parent_pid: int, build_loop: LoopBuilder) -> None:
    """The process's entry. ``in_addr``/``out_addr``: the HTTP process's sockets; ``in_addr`` for TP
    rank 0 only, which sends everything to ``out_addr``; the other TP ranks send only their own
    ``RankMetrics`` there (None: a node > 0 of a multi-node DP rank, which sends nothing; a
    ``tcp://`` address: node 0's rank channel, both ways, for a rank off node 0 under DP attention).
    ``build_loop``: the mode's loop builder (a module-level function, so it reaches a spawned
    process by name)."""
    _die_with_parent(rank.name)
    # Ctrl-C, and a SIGTERM to the whole group (systemd, `pdserve launch`), reach the ranks too; the
    # parent alone decides when ranks stop (after its drain), so they keep serving it until then
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tag = f"dp{rank.dp_rank}" if config.tp_size == 1 else f"dp{rank.dp_rank} tp{rank.tp_rank}"
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s"
    )
    if rank.cpus is not None:
        rank_affinity.pin(rank.cpus)
    import torch

    from pdserve.engine.model_executor import parallel

    torch.set_num_threads(rank.num_threads)
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, num_threads=rank.num_threads, device=rank.device)
    )
    dp_rank = rank.dp_rank
    leader = rank.tp_rank == 0
    ctx = zmq.Context()
    pull, push = rank_sockets.open_sockets(ctx, in_addr, out_addr, leader)
    seal, unseal = _channel_auth(config, rank, out_addr)
    send = rank_sockets.sender(push, leader, seal)
    try:
        if config.enable_dp_attention:
            parallel.init_dp_attention(dp_rank, config.dp_size, rank.dist_init_addr, config.dist_timeout,
                                       torch.device(rank.device), rank.tp_rank, config.attn_tp_size)
        else:
            parallel.init_tp(rank.tp_rank, config.tp_size, rank.dist_init_addr, config.dist_timeout,
                             torch.device(rank.device))
        loop = build_loop(config, dp_rank, rank.tp_rank)
        flush_on_stop(loop.cache)
        # KV events describe the DP rank's cache: TP rank 0 publishes them for all its TP ranks
        publish = _kv_event_publisher(config, dp_rank, loop.cache, ctx) if leader else None
        send([ready_info(loop, dp_rank, rank.num_threads)])

        def orphaned() -> bool:  # the parent died without killing us: nothing left to serve
            return not loop.has_work() and os.getppid() != parent_pid

        recv, should_stop = rank_sockets.inputs(pull, orphaned, unseal)
        _run_in_worker_thread(lambda: serve_rank(loop, dp_rank, recv, send, should_stop, publish, rank.tp_rank),
                              rank.num_threads)
    except Exception as e:
        logger.error("DP rank %d TP rank %d failed:\n%s", dp_rank, rank.tp_rank, traceback.format_exc())
        if config.tp_size > 1:
            time.sleep(PEER_FAILURE_GRACE)
        where = "" if config.tp_size == 1 else f"TP rank {rank.tp_rank}: "
        send([SchedulerError(dp_rank=dp_rank, message=f"{where}{type(e).__name__}: {e}")])
        ctx.destroy(linger=2000)  # closes every socket first: term() alone waits forever on an open one
        sys.exit(1)
    parallel.close_tp()


def _channel_auth(config: ServerConfig, rank: RankSpec, out_addr: str | None):
    """``(seal, unseal)`` of this rank's frames on node 0's rank channel, with the shared key
    (``ServerConfig.rank_channel_auth``): sealed from ``dp{D}-tp{T}`` to the channel's address and
    back; ``(None, None)`` over ipc or without a key."""
    auth = config.rank_channel_auth() if out_addr is not None and out_addr.startswith("tcp://") else None
    if auth is None:
        return None, None
    return (lambda payload: auth.seal(payload, rank.name, out_addr)), (lambda frame: auth.open(frame, rank.name))


def flush_on_stop(cache) -> None:
    """On SIGUSR1 (the server stopping: ``serve.stop_ranks``) close ``cache``, which sends its storage
    tier's queued puts (bounded: storage_worker.CLOSE_FLUSH_S), then exit as abruptly as the SIGKILL
    that follows would: nothing else in a rank needs a clean exit."""
    signal.signal(signal.SIGUSR1, lambda *_: (cache.close(), os._exit(0)))


def _kv_event_publisher(config: ServerConfig, dp_rank: int, cache, ctx: zmq.Context):
    """With ``--kv-events-config``: a publisher of the cache's events; returns what ``serve_rank``
    calls after each iteration (None without)."""
    if not config.kv_events.enabled:
        return None
    from pdserve.engine.mem_cache.kv_event_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher(config.kv_events, dp_rank, ctx, host=config.host)
    cache.enable_events()
    return lambda: publisher.publish(cache.drain_events())


def _run_in_worker_thread(fn, num_threads: int) -> None:
    """Run the loop in a worker thread, as the offline Engine does, and re-raise its error here.

    Why: measured on a shared 2-core machine, the same decode steps ran 10-30x slower with torch's
    OpenMP ops issued from the process's main thread than from a worker thread (20 tokens: 20-60 s
    against 0.7-2 s, with 2 torch threads either way)."""
    import torch

    errors: list[BaseException] = []

    def run() -> None:
        torch.set_num_threads(num_threads)  # OpenMP's thread count is per calling thread
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    worker = threading.Thread(target=run, name="pdserve-scheduler", daemon=True)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
