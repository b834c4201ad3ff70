"""Publish a rank's KV event batches over ZMQ, as vLLM and SGLang do.

Wire (vLLM's ``ZmqEventPublisher``):
- PUB socket on the rank's endpoint: multipart ``[topic, seq, payload]``, ``seq``
  an 8-byte big-endian counter from 0, ``payload`` a msgpack ``KVEventBatch``.
- ROUTER socket on the replay endpoint (optional): a client sends
  ``[b"", start_seq]`` (a DEALER; a REQ socket adds the empty frame itself) and
  gets ``[b"", seq, payload]`` for every kept batch with ``seq >= start_seq``,
  then ``[b"", -1 (8 bytes, signed), b""]``.

The events carry every cached page's token ids (prompt text, in effect) on an
unauthenticated socket: a wildcard bind host (``tcp://*:5557``) binds the
server's ``--host`` (``bind_endpoint``), so they are published where the server
listens, not on every interface; subscribers must be trusted (docs/KV_EVENTS.md).

One thread owns both sockets (ZMQ sockets are not thread-safe) and the ring
buffer of the last ``buffer_steps`` batches; the scheduler thread only
encodes a batch and puts it on a queue, so a slow subscriber never stalls a
model step (PUB drops past its high-water mark; a full queue drops and counts).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from pdserve.engine.kv_events_config import KVEventsConfig, bind_endpoint, rank_endpoint
from pdserve.engine.mem_cache.kv_events import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # last frame of a replay
_POLL_MS = 20  # how long the thread waits on the replay socket between queue drains


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, dp_rank: int, ctx: zmq.Context | None = None, host: str = ""):
        """``host``: the server's ``--host``, which a wildcard endpoint binds ("": the endpoint as given)."""
        self.config = config
        self.dp_rank = dp_rank
        self.endpoint = bind_endpoint(rank_endpoint(config.endpoint, dp_rank), host)
        self.replay_endpoint = (bind_endpoint(rank_endpoint(config.replay_endpoint, dp_rank), host)
                                if config.replay_endpoint else None)
        self.dropped = 0  # batches lost to a full queue
        self._topic = config.topic.encode()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._ctx = ctx or zmq.Context.instance()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"pdserve-kv-events-{dp_rank}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch of this rank's events (nothing when ``events`` is empty)."""
        if not events:
            return
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank))
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            logger.warning("kv events queue full: dropped a batch (%d so far)", self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within ``timeout``), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the daemon thread dies with the process
        self._thread.join(timeout)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            replay = None
            if self.replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = RuntimeError(f"kv events: cannot bind {self.endpoint} / {self.replay_endpoint}: {e}")
            self._ready.set()
            return
        self._ready.set()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        running = True
        while running:
            if replay is not None:
                if poller.poll(_POLL_MS):
                    self._serve_replay(replay, buffer)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    continue
            else:
                try:
                    item = self._queue.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    continue
            while item is not None:
                seq_bytes = seq.to_bytes(8, "big")
                pub.send_multipart((self._topic, seq_bytes, item), copy=False)
                buffer.append((seq, item))
                seq += 1
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            else:
                running = False
        pub.close()
        if replay is not None:
            replay.close()

    @staticmethod
    def _serve_replay(replay: zmq.Socket, buffer: deque[tuple[int, bytes]]) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events: malformed replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(buffer):
                if seq >= start_seq:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload), copy=False)
            replay.send_multipart((client, b"", END_SEQ, b""))
