"""How the tokenizer manager reaches its scheduler ranks.

``RankTransport`` is the one seam between the front end and the ranks: it
carries ``SchedulerInput``s to a rank and hands every ``SchedulerOutput`` back
on the front end's event loop. Two kinds:

- ``ZmqTransport`` (here): scheduler processes, one PUSH socket per rank and
  one PULL socket for all their outputs, msgspec-encoded (``pdserve serve``);
- ``LocalRank`` (``local_rank.py``): one rank on a thread of this process,
  messages passed by reference (the offline ``Engine``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from abc import ABC, abstractmethod
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from pdserve.engine.messages import SchedulerInput, SchedulerOutput

OnMessages = Callable[[list[SchedulerOutput]], None]

logger = logging.getLogger(__name__)


class RankTransport(ABC):
    @abstractmethod
    def send(self, rank: int, msg: SchedulerInput) -> None:
        """Queue ``msg`` for DP rank ``rank``; messages to one rank arrive in the order sent."""

    @abstractmethod
    def start(self, on_messages: OnMessages) -> None:
        """From now on, call ``on_messages`` on the running event loop with each batch of outputs
        the ranks send (one batch per rank step). Called once, from that loop."""

    @abstractmethod
    def close(self) -> None:
        """Stop delivering and release the transport's resources."""


class ZmqTransport(RankTransport):
    """Scheduler processes behind ipc sockets in a private temporary directory."""

    def __init__(self, dp_size: int):
        self._ipc_dir = tempfile.mkdtemp(prefix="pdserve-")
        # the scheduler processes connect to these (``run_scheduler_process``)
        self.rank_in_addrs = [f"ipc://{self._ipc_dir}/rank{r}" for r in range(dp_size)]
        self.out_addr = f"ipc://{self._ipc_dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push = []
        for addr in self.rank_in_addrs:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(addr)
            self._push.append(s)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.out_addr)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(list[SchedulerOutput])
        self._recv_task: asyncio.Task | None = None

    def send(self, rank: int, msg: SchedulerInput) -> None:
        self._push[rank].send(self._enc.encode(msg), copy=False)

    def start(self, on_messages: OnMessages) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(on_messages))

    async def _recv_loop(self, on_messages: OnMessages) -> None:
        """Every batch the ranks send, until closed; a batch that fails to decode or to apply is
        logged and the loop goes on (a dead loop would leave every request waiting forever)."""
        while True:
            frame = await self._pull.recv()
            try:
                on_messages(self._dec.decode(frame))
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("a batch of scheduler outputs failed; the receive loop goes on")

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        for s in self._push + [self._pull]:
            s.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
