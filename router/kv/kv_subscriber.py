"""Subscribe to the workers' KV events (ZMQ SUB), prefill and decode alike, and keep a ``KVIndex`` up to date.

One thread owns every socket (one SUB per worker DP rank, and a DEALER per rank
that has a replay endpoint) and applies each batch to the shared index under
the caller's lock. The wire is vLLM's (see ``pdserve.engine.mem_cache.kv_event_publisher``).

Faults never stop the thread; each is logged and counted in ``counts``:
- ``malformed``: a message that is not ``[topic, seq, payload]`` or a payload
  that does not decode. The rank's entries are dropped (its blocks are
  unknown now; an index that lists too little only costs a cache miss, one
  that lists too much sends requests to a worker without the blocks).
- ``gaps``: a sequence number ahead of the next one expected. The missing
  batches are asked from the replay endpoint; when there is none, it does not
  answer within ``replay_timeout``, or it no longer has them (``dropped``), the
  rank's entries are dropped and the stream goes on from the new batch.
- ``stale``: an already applied sequence number: ignored.
- ``restarts``: a stream counting from 0 again (the worker restarted): its
  entries are dropped first.
- ``bad_endpoint``: an endpoint ZMQ cannot connect to (from a worker's
  ``/server_info``): that rank is not subscribed.
- ``errors``: anything else that went wrong handling one rank's messages: its
  entries are dropped and the thread goes on.
- ``silent``: no batch for ``silence_timeout`` seconds. A publisher only sends
  when its cache changes, so silence is probed with a replay request (which
  also fetches anything missed); no answer, or no replay endpoint, drops the
  rank's entries until it speaks again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import msgspec
import zmq

from pdserve.engine.mem_cache.kv_event_publisher import END_SEQ
from pdserve.engine.mem_cache.kv_events import decode_batch
from pdserve.router.kv.kv_index import KVIndex, SeqAction, SeqTracker

log = logging.getLogger("pdserve.router.kv_events")

_POLL_MS = 50


@dataclass(frozen=True)
class EventSource:
    key: str  # the router endpoint key the rank's blocks are filed under
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class _Stream:
    def __init__(self, source: EventSource, sub: zmq.Socket):
        self.source = source
        self.sub = sub
        self.dealer: zmq.Socket | None = None
        self.seq = SeqTracker()
        self.last_heard = time.monotonic()
        self.silent = False


class KVEventSubscriber:
    def __init__(self, index: KVIndex, lock: threading.Lock, silence_timeout: float = 60.0,
                 replay_timeout: float = 1.0, ctx: zmq.Context | None = None):
        self.index = index
        self.lock = lock
        self.silence_timeout = silence_timeout
        self.replay_timeout = replay_timeout
        self.counts: Counter[str] = Counter()
        self._ctx = ctx or zmq.Context.instance()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[zmq.Socket, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-subscriber", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread
    def add(self, source: EventSource) -> None:
        self._commands.put(("add", source))

    def remove(self, key: str) -> None:
        """Unsubscribe ``key``'s streams and drop its entries."""
        self._commands.put(("remove", key))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            self._do_commands(poller)
            ready = dict(poller.poll(_POLL_MS)) if self._streams else {}
            if not self._streams:
                time.sleep(_POLL_MS / 1000)
            for sock in ready:
                stream = self._streams.get(sock)
                if stream is None:
                    continue
                try:
                    self._drain(stream)
                except Exception:  # noqa: BLE001 - one rank's trouble must not stop the others' events
                    self.counts["errors"] += 1
                    log.exception("handling KV events of %s failed: dropping its entries", stream.source.key)
                    with self.lock:
                        self.index.clear(stream.source.key)
            self._check_silence()
        for stream in self._streams.values():
            self._close_stream(stream)

    def _do_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                op, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                if any(s.source == arg for s in self._streams.values()):
                    continue
                self._drop_key(arg.key, poller)
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, arg.topic.encode())
                try:
                    sub.connect(arg.endpoint)
                except zmq.ZMQError as e:
                    sub.close(0)
                    self.counts["bad_endpoint"] += 1
                    log.warning("cannot subscribe to KV events of %s at %r: %s", arg.key, arg.endpoint, e)
                    continue
                poller.register(sub, zmq.POLLIN)
                self._streams[sub] = _Stream(arg, sub)
                log.info("subscribed to KV events of %s at %s", arg.key, arg.endpoint)
            else:
                self._drop_key(arg, poller)

    def _drop_key(self, key: str, poller: zmq.Poller) -> None:
        for sock, stream in list(self._streams.items()):
            if stream.source.key == key:
                poller.unregister(sock)
                self._close_stream(stream)
                del self._streams[sock]
        with self.lock:
            self.index.clear(key)

    @staticmethod
    def _close_stream(stream: _Stream) -> None:
        stream.sub.close(0)
        if stream.dealer is not None:
            stream.dealer.close(0)

    def _drain(self, stream: _Stream) -> None:
        while True:
            try:
                frames = stream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            stream.last_heard = time.monotonic()
            stream.silent = False
            if len(frames) != 3 or len(frames[1]) != 8:
                self._malformed(stream, f"{len(frames)} frames")
                continue
            self._on_batch(stream, int.from_bytes(frames[1], "big"), frames[2])

    def _on_batch(self, stream: _Stream, seq: int, payload: bytes) -> None:
        key = stream.source.key
        action = stream.seq.check(seq)
        if action is SeqAction.STALE:
            self.counts["stale"] += 1
            return
        if action is SeqAction.RESTART:
            self.counts["restarts"] += 1
            log.info("KV events of %s restarted from 0: dropping its entries", key)
            with self.lock:
                self.index.clear(key)
        elif action is SeqAction.GAP:
            self.counts["gaps"] += 1
            if not self._replay(stream, seq):
                self.counts["dropped"] += 1
                log.warning("KV events of %s: batches %d..%d lost, no replay: dropping its entries",
                            key, stream.seq.expected, seq - 1)
                with self.lock:
                    self.index.clear(key)
        self._apply(stream, seq, payload)

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> None:
        stream.seq.applied(seq)
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._malformed(stream, f"seq {seq}: {e}")
            return
        with self.lock:
            self.index.apply(stream.source.key, batch.events)

    def _malformed(self, stream: _Stream, what: str) -> None:
        self.counts["malformed"] += 1
        log.warning("malformed KV event batch from %s (%s): dropping its entries", stream.source.key, what)
        with self.lock:
            self.index.clear(stream.source.key)

    def _replay(self, stream: _Stream, upto: int | None) -> bool:
        """Fetch batches from the expected one on and apply those before ``upto`` (None: all).
        True when none was missing (the publisher answered and still had them)."""
        src = stream.source
        if not src.replay_endpoint:
            return False
        if stream.dealer is None:
            stream.dealer = self._ctx.socket(zmq.DEALER)
            stream.dealer.setsockopt(zmq.LINGER, 0)
            stream.dealer.connect(src.replay_endpoint)
        start = stream.seq.expected
        stream.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not stream.dealer.poll(int(left * 1000) + 1):
                # an answer may still come: a fresh socket, so it cannot be read as the next one's
                stream.dealer.close(0)
                stream.dealer = None
                log.warning("KV events replay from %s timed out", src.replay_endpoint)
                return False
            frames = stream.dealer.recv_multipart()
            if len(frames) != 3:
                continue
            if frames[1] == END_SEQ:
                break
            got.append((int.from_bytes(frames[1], "big"), frames[2]))
        self.counts["replays"] += 1
        wanted = [(s, p) for s, p in got if s >= start and (upto is None or s < upto)]
        last = (upto - 1) if upto is not None else (got[-1][0] if got else start - 1)
        if [s for s, _ in wanted] != list(range(start, last + 1)):
            return False  # the publisher's ring no longer has them
        for s, p in wanted:
            self._apply(stream, s, p)
        return True

    def _check_silence(self) -> None:
        now = time.monotonic()
        for stream in self._streams.values():
            if stream.silent or now - stream.last_heard < self.silence_timeout:
                continue
            if self._replay(stream, None):
                stream.last_heard = now
                continue
            stream.silent = True
            self.counts["silent"] += 1
            log.warning("no KV events from %s for %.0f s: dropping its entries", stream.source.key,
                        self.silence_timeout)
            with self.lock:
                self.index.clear(stream.source.key)
            stream.seq = SeqTracker()  # when it speaks again, everything before is asked for anew
