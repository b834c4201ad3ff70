"""One scheduler rank on a thread of this process: the offline Engine's transport.

``LocalRank`` runs the scheduler processes' own loop (``serve_rank``) over a
``SchedulerLoop`` built in this process, with a queue where a scheduler
process has its ZMQ socket. Messages pass by reference (no encoding), and the
outputs of each step reach the front end's event loop in one
``call_soon_threadsafe``.

Why a thread and not a scheduler process: the Engine's callers look inside the
loop between steps (``call``: ``check_integrity``, exact ``stats``, the
scheduler's counters in tests), and it starts faster for the same speed
(docs/PERFORMANCE.md, "Design choices").

The loop is built on the rank's thread, which then runs it, so every OpenMP parallel region
of the model (torch's and the native kernels', one libgomp) starts from that one thread and
the process has one OpenMP thread pool. A model built on the caller's thread would leave a
second pool there; with more OpenMP threads than cores in the process, libgomp stops spinning at
its barriers (its throttled spin count), and every region of a decode step waits for a sleeping
worker (the step took twice as long: docs/PERFORMANCE.md, "One OpenMP pool per process").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable, Iterator

import torch

from pdserve.engine.frontend.rank_transport import OnMessages, RankTransport
from pdserve.engine.messages import SchedulerError, SchedulerInput
from pdserve.engine.sched.rank_loop import ready_info, serve_rank

logger = logging.getLogger(__name__)

STOP_JOIN_TIMEOUT = 30.0  # seconds close() waits for the step in progress


class _Call:
    """A function to run on the rank's thread between steps, in order with the messages."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.future.set_exception(exc)


class LocalRank(RankTransport):
    DP_RANK = 0  # the offline Engine has one rank

    def __init__(self, build: Callable[[], Any]):
        """Start the rank's thread, build the loop there (``build()``) and wait for it: ``loop`` is
        it, or what the build raised is raised here. It serves from ``start`` on."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._ship: concurrent.futures.Future = concurrent.futures.Future()  # set by start(); None: closed
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="pdserve-engine-rank",
                                        daemon=True)
        self._thread.start()
        self.loop = built.result()

    def send(self, rank: int, msg: SchedulerInput) -> None:
        self._inbox.put(msg)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the rank's thread after the messages sent before it; its result or error
        arrives in the returned future."""
        call = _Call(fn)
        self._inbox.put(call)
        return call.future

    def start(self, on_messages: OnMessages) -> None:
        front = asyncio.get_running_loop()

        def ship(msgs: list) -> None:
            front.call_soon_threadsafe(on_messages, msgs)

        self._hand_ship(ship)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _hand_ship(self, ship: Callable[[list], None] | None) -> None:
        try:
            self._ship.set_result(ship)
        except concurrent.futures.InvalidStateError:  # started or closed already
            pass

    def _run(self, build: Callable[[], Any], built: concurrent.futures.Future) -> None:
        try:
            loop = build()
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor's thread
            built.set_exception(exc)
            return
        built.set_result(loop)
        ship = self._ship.result()
        if ship is None:  # closed before it started
            return
        try:
            ship([ready_info(loop, self.DP_RANK, torch.get_num_threads())])
            serve_rank(loop, self.DP_RANK, self._recv, ship, self._stopped.is_set)
        except BaseException as exc:  # the rank is dead: the front end fails what is in flight
            logger.exception("the engine's scheduler loop failed")
            ship([SchedulerError(dp_rank=self.DP_RANK, message=f"{type(exc).__name__}: {exc}")])

    def _recv(self, timeout_ms: int) -> Iterator[SchedulerInput]:
        # a generator: each message is handled before the next item is taken, so a call sees
        # exactly the messages sent before it
        try:
            item = self._inbox.get(timeout=timeout_ms / 1000) if timeout_ms else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Call):
                item.run()
            else:
                yield item
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        self._stopped.set()
        self._hand_ship(None)
        self._thread.join(STOP_JOIN_TIMEOUT)
