"""Entry function of one DP-rank scheduler process.

``run_scheduler_process`` builds the rank's loop (``SchedulerLoop`` in
colocated mode; the prefill and decode loops register themselves in
``LOOP_BUILDERS``), announces itself with ``SchedulerReady``, then runs
``serve_rank``: receive ``SchedulerInput``s from the HTTP process, step while
there is work, send the ``TokenOutput``s of each step (one message per step)
and a ``SchedulerStats`` at most every ``STATS_INTERVAL`` seconds or when it
changes. The offline Engine runs the same ``serve_rank`` on a thread.
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
from typing import Callable, Iterable, Iterator

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
    from pdserve.prefill.prefill_loop import PrefillLoop

    return PrefillLoop(
        config.engine,
        dp_rank=dp_rank,
        kv_config=config.kv_transfer_config(),
        bootstrap_port=config.disaggregation_bootstrap_port,
        bootstrap_host=config.advertise_host,
    )


def _build_decode_loop(config: ServerConfig, dp_rank: int):
    from pdserve.decode.decode_loop import DecodeLoop

    return DecodeLoop(config.engine, dp_rank=dp_rank, kv_config=config.kv_transfer_config())


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


def ready_info(loop, dp_rank: int, num_threads: int) -> SchedulerReady:
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
    dec = msgspec.msgpack.Decoder(SchedulerInput)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)

    def send(msgs: list) -> None:
        push.send(enc.encode(msgs), copy=False)

    def recv(timeout_ms: int) -> Iterator[SchedulerInput]:
        if poller.poll(timeout_ms):
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                yield dec.decode(raw)

    try:
        loop = LOOP_BUILDERS[config.disaggregation_mode](config, dp_rank)
        send([ready_info(loop, dp_rank, num_threads)])

        def orphaned() -> bool:  # the parent died without killing us: nothing left to serve
            return not loop.has_work() and os.getppid() != parent_pid

        _run_in_worker_thread(lambda: serve_rank(loop, dp_rank, recv, send, orphaned), num_threads)
    except Exception as e:
        logger.error("DP rank %d failed:\n%s", dp_rank, traceback.format_exc())
        send([SchedulerError(dp_rank=dp_rank, message=f"{type(e).__name__}: {e}")])
        push.close(linger=2000)
        ctx.term()
        sys.exit(1)


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


def serve_rank(
    loop,
    dp_rank: int,
    recv: Callable[[int], Iterable[SchedulerInput]],
    send: Callable[[list], None],
    should_stop: Callable[[], bool],
) -> None:
    """The rank's loop, whatever carries its messages: take the inputs ``recv(timeout_ms)`` yields
    (waiting up to ``timeout_ms`` for the first, 0 while there is work), step, ``send`` the step's
    outputs and now and then a ``SchedulerStats``; until ``should_stop()``. A scheduler process
    feeds it from ZMQ; the offline Engine's ``LocalRank`` from a queue."""
    last_stats = _stats(loop, dp_rank)
    send([last_stats])
    last_stats_time = time.monotonic()
    while not should_stop():
        busy = loop.has_work()
        for msg in recv(0 if busy else IDLE_POLL_MS):
            _handle(loop, msg)
        outs = loop.step() if loop.has_work() else []
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
