"""How the tokenizer manager reaches its scheduler ranks.

``RankTransport`` is the one seam between the front end and the ranks: it
carries ``SchedulerInput``s to a rank and hands every ``SchedulerOutput`` back
on the front end's event loop. Two kinds:

- ``ZmqTransport`` (here): scheduler processes, one PUSH socket per rank and
  one PULL socket for all their outputs, msgspec-encoded (``pdserve serve``);
  under DP attention across nodes, the ranks of other nodes over one TCP ROUTER
  socket beside them (``RemoteRanks``);
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

from pdserve.engine.messages import RankMetrics, SchedulerError, SchedulerInput, SchedulerOutput, SchedulerReady

OnMessages = Callable[[list[SchedulerOutput]], None]
# the largest frame the rank channel takes (a batch of outputs with prompt logprobs fits well
# within it); a peer sending a larger one is disconnected by ZMQ before it is buffered whole
MAX_CHANNEL_FRAME = 256 << 20

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
    """Scheduler processes behind ipc sockets in a private temporary directory; with ``remote``,
    the DP ranks whose leader runs on another node behind its TCP socket."""

    def __init__(self, dp_size: int, remote: "RemoteRanks | None" = None):
        self._ipc_dir = tempfile.mkdtemp(prefix="pdserve-")
        self.remote = remote
        local = [r for r in range(dp_size) if remote is None or r not in remote.groups]
        # the scheduler processes connect to these (``run_scheduler_process``); None: a remote rank
        self.rank_in_addrs: list[str | None] = [
            f"ipc://{self._ipc_dir}/rank{r}" if r in local else None for r in range(dp_size)]
        self.out_addr = f"ipc://{self._ipc_dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push: list[zmq.asyncio.Socket | None] = [None] * dp_size
        for r in local:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(self.rank_in_addrs[r])
            self._push[r] = s
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.out_addr)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(list[SchedulerOutput])
        self._tasks: list[asyncio.Task] = []
        if remote is not None:
            remote.bind(self._ctx)

    def send(self, rank: int, msg: SchedulerInput) -> None:
        push = self._push[rank]
        if push is None:
            self.remote.send(rank, self._enc.encode(msg))
        else:
            push.send(self._enc.encode(msg), copy=False)

    def start(self, on_messages: OnMessages) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._recv_loop(on_messages)))
        if self.remote is not None:
            self._tasks.append(loop.create_task(self.remote.recv_loop(on_messages)))

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
        for task in self._tasks:
            task.cancel()
        for s in [p for p in self._push if p is not None] + [self._pull]:
            s.close(linger=0)
        if self.remote is not None:
            self.remote.close()
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class RemoteRanks:
    """The front end's side of the rank channel (DP attention across nodes): one ZMQ ROUTER at
    ``addr`` (``ServerConfig.rank_channel_addr``, bound to that host's interface only) that every
    scheduler process off node 0, and every other node's server process, connects a DEALER to.

    Who may say what, since a stranger may reach the port too: every frame must open under
    ``auth`` (the shared key, when configured: sender and receiver named in the tag, no replay)
    and decode as a list of ``SchedulerOutput``, else it is dropped with a log line. A DEALER
    becomes group ``g``'s leader by its first ``SchedulerReady`` of a remote group ``g`` (with a
    key: sealed by ``dp{g}-tp0``); the group's inputs go to it alone, and only it may send the
    group's outputs, stats and control results. ``RankMetrics`` are taken for a rank off node 0
    and ``SchedulerError`` (another node's rank that died) for a DP rank with a rank off node 0;
    anything else from an unknown peer is dropped. So nothing a peer sends reaches the tokenizer manager outside
    these rules, and no frame can end the receive loop.
    """

    def __init__(self, addr: str, off_node0: set[tuple[int, int]], auth=None):
        self.addr = addr
        self.off_node0 = off_node0  # (dp, tp) of every rank off node 0
        self.groups = {dp for dp, tp in off_node0 if tp == 0}  # DP ranks whose leader runs off node 0
        self.auth = auth
        self.leaders: dict[int, bytes] = {}  # DP rank -> its leader's ZMQ routing id
        self.failure: str | None = None  # the first SchedulerError another node sent
        self._router = None
        self._dec = msgspec.msgpack.Decoder(list[SchedulerOutput])

    def bind(self, ctx: zmq.asyncio.Context) -> None:
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_CHANNEL_FRAME)
        # a ROUTER drops what a full or unknown peer cannot take; here nothing is dropped unseen:
        # no send limit (the front end's admission bounds what is in flight, as over ipc), and a
        # leader that is gone fails the send, which is logged (``_sent``)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.addr.startswith("tcp://["):
            s.setsockopt(zmq.IPV6, 1)
        s.bind(bind_addr(self.addr))
        self._router = s

    def send(self, rank: int, payload: bytes) -> None:
        """To DP rank ``rank``'s leader; dropped (logged) while it has not announced itself, which
        the front end's wait for every rank's ``SchedulerReady`` rules out."""
        leader = self.leaders.get(rank)
        if leader is None:
            logger.warning("no leader of DP rank %d on the rank channel yet: message dropped", rank)
            return
        if self.auth is not None:
            payload = self.auth.seal(payload, self.addr, f"dp{rank}-tp0")
        sent = self._router.send_multipart([leader, payload], copy=False)
        sent.add_done_callback(lambda f: _sent(f, rank))

    async def recv_loop(self, on_messages: OnMessages) -> None:
        while True:
            parts = await self._router.recv_multipart()
            try:
                msgs = self.admit(parts)
            except Exception as e:  # noqa: BLE001 - a stranger's frame: dropped, the loop goes on
                logger.warning("rank channel: frame dropped (%s: %s)", type(e).__name__, e)
                continue
            if not msgs:
                continue
            try:
                on_messages(msgs)
            except Exception:  # noqa: BLE001 - as ZmqTransport._recv_loop
                logger.exception("a batch of scheduler outputs failed; the receive loop goes on")

    def admit(self, parts: list[bytes]) -> list[SchedulerOutput]:
        """The messages of one ROUTER frame ``[routing id, payload]`` that the rules above let
        through; raises on a frame that does not authenticate or decode."""
        if len(parts) != 2:
            raise ValueError(f"{len(parts)} parts, want 2")
        peer, frame = parts
        sender = None
        if self.auth is not None:
            sender, frame = self.auth.open_from(frame, self.addr)
        msgs = self._dec.decode(frame)
        group = next((g for g, p in self.leaders.items() if p == peer), None)
        out = []
        for msg in msgs:
            if isinstance(msg, SchedulerReady):
                ok = (msg.dp_rank in self.groups and msg.dp_rank not in self.leaders and group is None
                      and sender in (None, f"dp{msg.dp_rank}-tp0"))
                if ok:
                    self.leaders[msg.dp_rank] = peer
                    group = msg.dp_rank
            elif isinstance(msg, RankMetrics):
                ok = (msg.dp_rank, msg.tp_rank) in self.off_node0
            elif isinstance(msg, SchedulerError):
                ok = any(d == msg.dp_rank for d, _ in self.off_node0)
                if ok and self.failure is None:
                    self.failure = f"DP rank {msg.dp_rank} failed: {msg.message}"
            else:  # a group's outputs, stats, control results: from its leader only
                ok = group is not None and getattr(msg, "dp_rank", group) == group
            if ok:
                out.append(msg)
            else:
                logger.warning("rank channel: %s dropped (not from a rank that may send it)", type(msg).__name__)
        return out

    def close(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)


def _sent(f: asyncio.Future, rank: int) -> None:
    if not f.cancelled() and f.exception() is not None:
        logger.error("rank channel: a message to DP rank %d was not sent (%s)", rank, f.exception())


def bind_addr(addr: str) -> str:
    """``tcp://host:port`` with a host name resolved to its address (ZMQ binds addresses and
    interfaces only), so the socket listens on that one interface."""
    import socket

    host, _, port = addr[len("tcp://"):].rpartition(":")
    if host.startswith("["):
        return addr
    return f"tcp://{socket.gethostbyname(host)}:{port}"
