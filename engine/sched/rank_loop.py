"""The loop of one scheduler rank, whatever carries its messages: take inputs, step, send outputs.

A scheduler process runs it over ZMQ (``scheduler_process.py``, the process plumbing;
``rank_sockets.py``, its sockets), the offline Engine's ``LocalRank`` on a thread over a queue. Requests, aborts and control operations go through
the rank's ``RankControl`` (``rank_control.py``); the loop sends a ``SchedulerStats`` at most every
``STATS_INTERVAL`` seconds or when it changes.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import msgspec

from pdserve.engine.messages import SchedulerInput, SchedulerReady, SchedulerStats
from pdserve.engine.model_executor import dp_attention
from pdserve.engine.sched.rank_control import RankControl

logger = logging.getLogger(__name__)

STATS_INTERVAL = 0.05  # seconds between stats while busy
HEARTBEAT_INTERVAL = 1.0  # the stats go out at least this often, changed or not: the front end's heartbeat
IDLE_POLL_MS = 20  # how long an idle rank blocks waiting for input


def ready_info(loop, dp_rank: int, num_threads: int) -> SchedulerReady:
    arch, pool = loop.arch, loop.pool
    return SchedulerReady(
        dp_rank=dp_rank,
        vocab_size=arch.vocab_size,
        max_context_len=arch.max_context_len,
        eos_token_ids=list(arch.eos_token_ids),
        page_size=pool.page_size,
        max_total_num_tokens=pool.max_total_tokens,
        kv_pool_bytes=getattr(loop.runner, "kv_pool_bytes", 0),
        num_threads=num_threads,
    )


def _stats(loop, dp_rank: int) -> SchedulerStats:
    s = loop.stats()
    return s if s.dp_rank == dp_rank else msgspec.structs.replace(s, dp_rank=dp_rank)


def serve_rank(
    loop,
    dp_rank: int,
    recv: Callable[[int], Iterable[SchedulerInput]],
    send: Callable[[list], None],
    should_stop: Callable[[], bool],
    after_step: Callable[[], None] | None = None,
    tp_rank: int = 0,
) -> None:
    """The rank's loop, whatever carries its messages: take the inputs ``recv(timeout_ms)`` yields
    (waiting up to ``timeout_ms`` for the first, 0 while there is work), step, ``send`` the step's
    outputs and now and then a ``SchedulerStats``; until ``should_stop()``. A scheduler process
    feeds it from ZMQ (``rank_sockets.inputs``; a TP rank > 0 follows rank 0's broadcast and its ``send``
    drops everything but its ``RankMetrics``, sent like the stats when they changed); the offline
    Engine's ``LocalRank`` from a queue. ``after_step``: run after each iteration (the KV event
    publisher). Requests, aborts and control operations go through the rank's ``RankControl``
    (``rank_control.py``). Under DP attention every iteration ends in ``dp_attention.finish_iteration``:
    the rank runs idle forwards (of the model each round names: the target's or the draft's)
    beside the other attention groups' until all are done, and while
    another group was busy it polls without waiting, so that group never waits on this one's poll."""
    control = RankControl(loop, dp_rank, tp_rank)
    loop.ship_early = send  # a PD decode's first token leaves before the step it joins, not after
    last_stats = _stats(loop, dp_rank)
    last_metrics = loop.rank_metrics()
    send([last_stats] if last_metrics is None else [last_stats, last_metrics])
    last_stats_time = last_sent_time = time.monotonic()
    others_busy = False  # DP attention: another group ran a forward in the last iteration
    while not should_stop():
        busy = loop.has_work() or others_busy
        msgs: list = []
        for msg in recv(0 if busy else IDLE_POLL_MS):
            msgs.extend(control.handle(msg))
        msgs.extend(control.poll())
        if loop.has_work():
            msgs.extend(loop.step())
            control.after_step()
        # DP attention: join the other groups' forwards until every group is done with this iteration
        others_busy = dp_attention.finish_iteration(loop.runner.idle_forward) > 0 if dp_attention.enabled() else False
        if after_step is not None:
            try:
                after_step()
            except Exception:  # noqa: BLE001 - a hook (the KV event publisher) must not end the rank
                logger.exception("after-step hook failed; the rank goes on")
        now = time.monotonic()
        if now - last_stats_time >= STATS_INTERVAL:
            stats = _stats(loop, dp_rank)
            if stats != last_stats or now - last_sent_time >= HEARTBEAT_INTERVAL:
                msgs.append(stats)
                last_stats, last_sent_time = stats, now
            metrics = loop.rank_metrics()
            if metrics != last_metrics:
                msgs.append(metrics)
                last_metrics = metrics
            last_stats_time = now
        if msgs:
            send(msgs)
