"""Entry function of one DP-rank scheduler process.

``run_scheduler_process`` builds the rank's loop (``SchedulerLoop`` in
colocated mode; the prefill and decode loops register themselves in
``LOOP_BUILDERS``), announces itself with ``SchedulerReady``, then loops:
receive ``SchedulerInput``s from the HTTP process, step while there is work,
send the ``TokenOutput``s of each step (one message per step) and a
``SchedulerStats`` at most every ``STATS_INTERVAL`` seconds or when it changes.
The process dies with its parent (PR_SET_PDEATHSIG), so no rank outlives a
killed server.
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
from typing import Callable

import msgspec
import zmq

from pdserve.engine.messages import (
    AbortReq,
    FlushCacheReq,
    SchedulerError,
    SchedulerInput,
    SchedulerReady,
    SchedulerStats,
    TokenizedGenerateReq,
)
from pdserve.engine.server_config import ServerConfig

logger = logging.getLogger(__name__)

STATS_INTERVAL = 0.05  # seconds between stats while busy
IDLE_POLL_MS = 20  # how long an idle rank blocks waiting for input


def _build_null_loop(config: ServerConfig, dp_rank: int):
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop

    return SchedulerLoop(config.engine, dp_rank=dp_rank)


def _build_prefill_loop(config: ServerConfig, dp_rank: int):
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.kvtransfer.prefill_kv_manager import PrefillKVManager
    from pdserve.prefill.prefill_loop import PrefillLoop

    runner = ModelRunner(config.engine)
    kv = PrefillKVManager(
        config.kv_transfer_config(), runner.page_pool, dp_rank=dp_rank, bootstrap_host=config.advertise_host
    ).start()
    return PrefillLoop(config.engine, kv, dp_rank=dp_rank, runner=runner)


def _build_decode_loop(config: ServerConfig, dp_rank: int):
    from pdserve.decode.decode_loop import DecodeLoop
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager

    runner = ModelRunner(config.engine)
    kv = DecodeKVManager(config.kv_transfer_config(), runner.page_pool).start()
    return DecodeLoop(config.engine, kv, dp_rank=dp_rank, runner=runner,
                      max_local_prefill_tokens=config.max_local_prefill_tokens)


# disaggregation mode -> builder of the rank's loop (add_request, abort, step, has_work, stats)
LOOP_BUILDERS: dict[str, Callable[[ServerConfig, int], object]] = {
    "null": _build_null_loop,
    "prefill": _build_prefill_loop,
    "decode": _build_decode_loop,
}


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _ready_info(loop, dp_rank: int, num_threads: int) -> SchedulerReady:
    arch, pool = loop.arch, loop.pool
    return SchedulerReady(
        dp_rank=dp_rank,
        vocab_size=arch.vocab_size,
        max_context_len=arch.max_context_len,
        eos_token_ids=list(arch.eos_token_ids),
        page_size=pool.page_size,
        max_total_num_tokens=pool.max_total_tokens,
        num_threads=num_threads,
    )


def run_scheduler_process(
    config: ServerConfig, dp_rank: int, in_addr: str, out_addr: str, parent_pid: int, num_threads: int
) -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole process group; the parent alone decides when ranks stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s [dp{dp_rank}] %(levelname)s %(name)s: %(message)s"
    )
    import torch

    torch.set_num_threads(num_threads)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_threads=num_threads))

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)
    enc = msgspec.msgpack.Encoder()

    def send(msgs: list) -> None:
        push.send(enc.encode(msgs), copy=False)

    try:
        loop = LOOP_BUILDERS[config.disaggregation_mode](config, dp_rank)
        publish = _kv_event_publisher(config, dp_rank, loop.cache, ctx)
        send([_ready_info(loop, dp_rank, num_threads)])
        _run_in_worker_thread(lambda: _serve(loop, dp_rank, pull, send, parent_pid, publish), num_threads)
    except Exception as e:
        logger.error("DP rank %d failed:\n%s", dp_rank, traceback.format_exc())
        send([SchedulerError(dp_rank=dp_rank, message=f"{type(e).__name__}: {e}")])
        push.close(linger=2000)
        ctx.term()
        sys.exit(1)


def _kv_event_publisher(config: ServerConfig, dp_rank: int, cache, ctx: zmq.Context):
    """With ``--kv-events-config``: a publisher of the cache's events; returns what ``_serve``
    calls once per iteration (None without)."""
    if not config.kv_events.enabled:
        return None
    from pdserve.engine.kv_event_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher(config.kv_events, dp_rank, ctx)
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


def _stats(loop, dp_rank: int) -> SchedulerStats:
    s = loop.stats()
    return s if s.dp_rank == dp_rank else msgspec.structs.replace(s, dp_rank=dp_rank)


def _handle(loop, msg) -> None:
    if isinstance(msg, TokenizedGenerateReq):
        loop.add_request(msg)
    elif isinstance(msg, AbortReq):
        loop.abort(msg.rid)
    elif isinstance(msg, FlushCacheReq):
        loop.flush_cache()


def _serve(loop, dp_rank: int, pull: zmq.Socket, send, parent_pid: int, publish=None) -> None:
    dec = msgspec.msgpack.Decoder(SchedulerInput)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    last_stats = _stats(loop, dp_rank)
    send([last_stats])
    last_stats_time = time.monotonic()
    while True:
        busy = loop.has_work()
        if poller.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                _handle(loop, dec.decode(raw))
        outs = loop.step() if loop.has_work() else []
        if publish is not None:
            publish()
        now = time.monotonic()
        msgs: list = list(outs)
        if now - last_stats_time >= STATS_INTERVAL:
            stats = _stats(loop, dp_rank)
            if stats != last_stats or now - last_stats_time >= 1.0:
                msgs.append(stats)
                last_stats = stats
            last_stats_time = now
        if msgs:
            send(msgs)
        if not busy and os.getppid() != parent_pid:
            return  # orphaned (the parent died without killing us): nothing left to serve
