"""The ZMQ side of a scheduler process: its sockets to the HTTP process, the ``send`` and the
``(recv, should_stop)`` that ``rank_loop.serve_rank`` runs over.

Tensor parallel (SGLang's design): TP rank 0 alone reads the HTTP process's messages; each
iteration it broadcasts the raw messages it received (and whether to stop) to the other TP ranks,
which apply them in the same order, so every rank makes the same scheduling decisions, page
allocations and samples, and only rank 0 sends outputs (the others send their own ``RankMetrics``).

Under DP attention across nodes a rank off node 0 has one DEALER to node 0's rank channel
(``dealer``) for both ways, its frames sealed with the shared key when one is configured.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import msgspec
import zmq

from pdserve.engine.messages import RankMetrics, SchedulerInput

logger = logging.getLogger(__name__)


def open_sockets(ctx: zmq.Context, in_addr: str | None, out_addr: str | None,
                 leader: bool) -> tuple[zmq.Socket | None, zmq.Socket | None]:
    """``(pull, push)``: ``pull`` from ``in_addr`` for TP rank 0 (``leader``) only, ``push`` to
    ``out_addr`` unless it is None (a node > 0 of a multi-node DP rank, which sends nothing).
    A ``tcp://`` ``out_addr`` is node 0's rank channel (DP attention across nodes): one DEALER
    both ways (``dealer``)."""
    if out_addr is not None and out_addr.startswith("tcp://"):
        sock = dealer(ctx, out_addr)
        return (sock if leader else None), sock
    pull = push = None
    if leader:
        pull = ctx.socket(zmq.PULL)
        pull.connect(in_addr)
    if out_addr is not None:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(out_addr)
    return pull, push


def dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A DEALER connected to node 0's rank channel at ``addr`` (``RemoteRanks`` there). ZMQ
    connects in the background and again after a drop, so node 0 may start before or after this
    node; the routing id is random, and stays across reconnects, so that the front end, which
    learns a group's leader from its first ``SchedulerReady``, keeps reaching it."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.RCVHWM, 0)  # what node 0 sends waits here, never dropped (its ROUTER's SNDHWM too)
    if addr.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(addr)
    return sock


def sender(push: zmq.Socket | None, leader: bool, seal: Callable[[bytes], bytes] | None = None
           ) -> Callable[[list], None]:
    """The rank's ``send``: everything from TP rank 0, only its own ``RankMetrics`` from another;
    ``seal``: the rank channel's authentication of each frame (None: sent as encoded)."""
    enc = msgspec.msgpack.Encoder()

    def send(msgs: list) -> None:
        if not leader:  # rank 0 speaks for the TP group; each rank's own metrics are its own
            msgs = [msg for msg in msgs if isinstance(msg, RankMetrics)]
        if push is not None and msgs:
            payload = enc.encode(msgs)
            push.send(seal(payload) if seal is not None else payload, copy=False)

    return send


def _receive(pull: zmq.Socket, poller: zmq.Poller, timeout_ms: int) -> list[bytes]:
    """The raw messages waiting (blocking up to ``timeout_ms`` for the first)."""
    raws: list[bytes] = []
    if poller.poll(timeout_ms):
        while True:
            try:
                raws.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return raws
    return raws


def _opened(raws: list[bytes], unseal: Callable[[bytes], bytes] | None) -> list[bytes]:
    """``raws`` as sent by the front end: each opened by ``unseal`` (None: as they are); a frame
    that does not open is dropped and logged, never applied."""
    if unseal is None:
        return raws
    out = []
    for raw in raws:
        try:
            out.append(unseal(raw))
        except Exception as e:  # noqa: BLE001 - a stranger's frame
            logger.warning("rank channel: input frame dropped (%s: %s)", type(e).__name__, e)
    return out


def inputs(pull: zmq.Socket | None, orphaned: Callable[[], bool], unseal: Callable[[bytes], bytes] | None = None):
    """``(recv, should_stop)`` for ``serve_rank`` in a scheduler process.

    TP rank 0 (``pull`` set) reads the HTTP process's messages (opened by ``unseal`` on the rank
    channel). At TP > 1 it broadcasts them each
    iteration, with whether to stop, and the other ranks follow, so all step in lockstep: every
    rank's ``should_stop`` answers what rank 0 broadcast in the previous iteration.

    PD modes under TP: each TP rank's KV manager moves its own heads; a decision that depends
    on rank-local state, such as whether a KV transfer has landed, is agreed inside the loops'
    ``poll`` (``kvtransfer/tp_agreement.py``), so every rank still takes the same steps.
    """
    from pdserve.engine.model_executor.parallel import broadcast_objects, tp_size

    dec = msgspec.msgpack.Decoder(SchedulerInput)
    poller = zmq.Poller()
    if pull is not None:
        poller.register(pull, zmq.POLLIN)
    if tp_size() == 1:
        return (lambda timeout_ms: [dec.decode(raw) for raw in _opened(_receive(pull, poller, timeout_ms), unseal)]
                ), orphaned
    stop = [False]

    def recv(timeout_ms: int) -> list[SchedulerInput]:
        mine = [_opened(_receive(pull, poller, timeout_ms), unseal), orphaned()] if pull is not None else None
        raws, stop[0] = broadcast_objects(mine)
        return [dec.decode(raw) for raw in raws]

    return recv, lambda: stop[0]
