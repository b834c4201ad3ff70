"""What prefill and decode KV managers share: the transfer engine, the ZMQ control
channel and the one control thread that owns every socket.

Life cycle: the manager is built with its rank's page pool (every layer's K and V buffer is
registered with the transfer engine, and its control socket bound), ``start()`` runs the
control thread, ``close()`` stops it, closes the sockets, deregisters the memory and releases
the engine. In between, the scheduler thread never touches a socket: it calls
``create_sender`` / ``create_receiver`` / ``send`` / ``init`` / ``abort`` (which only update
state under ``lock`` and queue work) and ``poll()`` (an attribute read). The control thread
runs queued calls (``call_soon``), reads incoming frames (authenticated when a key is set,
decoded, handed to ``_on_message``) and fires the timers (``_on_timer``).

Owns the engine and its registrations, the control sockets, the control thread and the lock.
The subclasses compose the rest (``prefill_kv_manager``, ``decode_kv_manager``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import zmq

import pdserve.kvtransfer.messages as m
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.kv_auth import AuthError
from pdserve.engine.kv_transfer_config import KVTransferConfig
from pdserve.kvtransfer.room_metrics import RoomMetrics
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine, create_transfer_engine

logger = logging.getLogger(__name__)

_TIMER_PERIOD_S = 0.05
_DROP_LINGER_MS = 1000
MAX_PUSH_SOCKETS = 256  # per-endpoint sockets kept open; past this the least recently used one closes
_REFUSAL_LOG_PERIOD_S = 5.0  # a flood of unauthenticated frames logs once per period, with its count


class KVManager(ABC):
    role: str = ""

    def __init__(
        self,
        config: KVTransferConfig,
        pool: PagePool,
        engine: TransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``engine``: default, the one ``config.backend`` names. ``clock``: what every timeout
        (bootstrap, waiting, room retention, heartbeat) reads; tests inject one to move time."""
        self.config = config
        self.pool = pool
        self.clock = clock
        self.layout = m.LayoutInfo.from_layout(pool.layout())
        infos = pool.buffer_infos()
        self.page_bytes = infos[0].page_bytes
        # head-major pools (page_pool): a head's page, and a head's plane of pages, in every buffer
        self.head_page_bytes = infos[0].head_page_bytes
        self.plane_bytes = infos[0].plane_bytes
        self.k_addrs = [b.base_addr for b in infos[: pool.num_layers]]
        self.v_addrs = [b.base_addr for b in infos[pool.num_layers :]]
        # this rank's rooms for /metrics; a page of a room is every layer's K and V buffer's page
        self.metrics = RoomMetrics(self.role, sum(b.page_bytes for b in infos))
        self.engine = engine or create_transfer_engine(config.backend, config.host, config.ib_device)
        self._registered: list[int] = []
        for b in infos:
            self._register(b.base_addr, b.nbytes, b.device)
        self.lock = threading.Lock()  # guards room state transitions and room tables
        # None: no key configured, frames travel unsealed (the decoder still drops garbage)
        self.auth = config.frame_auth("control")
        self.auth_refused = 0  # control frames refused by authentication (SchedulerStats -> /metrics)
        self._refusal_logged_at = float("-inf")
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if config.control_port:
            self._pull.bind(f"tcp://{config.host}:{config.control_port}")
            port = config.control_port
        else:
            port = self._pull.bind_to_random_port(f"tcp://{config.host}")
        self.endpoint = f"{config.host}:{port}"
        self.id = f"{self.role}-{self.endpoint}-{uuid.uuid4().hex[:8]}"
        self._push: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._control_loop, name=f"kv-{self.role}-control", daemon=True)

    def _register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        self.engine.register(addr, nbytes, device)
        self._registered.append(addr)

    def start(self) -> "KVManager":
        self._thread.start()
        return self

    # -------------------------------------------------------------- control thread
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the control thread (from any thread)."""
        if self._stop.is_set():
            return
        self._calls.put(fn)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the control thread is already due to wake

    def send_msg(self, endpoint: str, msg: m.ControlMessage) -> None:
        """Control thread only: send ``msg`` to a peer's control endpoint, never blocking."""
        sock = self._push.get(endpoint)
        if sock is None:
            while len(self._push) >= MAX_PUSH_SOCKETS:
                self.drop_endpoint(next(iter(self._push)))
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(f"tcp://{endpoint}")
            self._push[endpoint] = sock
        else:
            self._push.move_to_end(endpoint)
        try:
            sock.send(self.frame(msg, endpoint), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kv %s: control queue to %s full, dropped %s", self.role, endpoint, type(msg).__name__)

    def frame(self, msg: m.ControlMessage, endpoint: str) -> bytes:
        """``msg`` as it goes on the wire to ``endpoint``: encoded, and sealed from this rank's
        endpoint for that one when a key is configured (any thread)."""
        payload = m.encode(msg)
        return payload if self.auth is None else self.auth.seal(payload, self.endpoint, endpoint)

    @property
    def open_endpoints(self) -> list[str]:
        """The peers this rank holds a control socket to (tests, /metrics)."""
        return list(self._push)

    def drop_endpoint(self, endpoint: str) -> None:
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            # a short linger: aborts queued just before the drop still reach a peer that wakes up
            sock.close(linger=_DROP_LINGER_MS)

    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._on_start()
        next_timer = 0.0
        while not self._stop.is_set():
            timeout_ms = 1 if self._wants_fast_poll() else int(_TIMER_PERIOD_S * 1000)
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            while True:
                try:
                    fn = self._calls.get_nowait()
                except queue.Empty:
                    break
                self._guard(fn)
            # always: replies that came while a call above ran count before the timers judge a peer
            self._drain_frames()
            self._guard(self._on_tick)
            # timers fire every period of real time and read the (maybe injected) clock
            if time.monotonic() >= next_timer:
                next_timer = time.monotonic() + _TIMER_PERIOD_S
                now = self.clock()
                self._guard(lambda: self._on_timer(now))

    def _drain_frames(self) -> None:
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            sender = None
            if self.auth is not None:
                try:
                    sender, frame = self.auth.open_from(frame, self.endpoint)
                except AuthError as e:
                    self._refuse(len(frame), str(e))
                    continue
            try:
                msg = m.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # garbage or truncated frames from the network are dropped, never fatal
                logger.warning("kv %s: rejected bad control frame (%d bytes): %s", self.role, len(frame), e)
                continue
            reply_to = getattr(msg, "endpoint", "")
            if sender is not None and reply_to and reply_to != sender:
                # a key holder may not send replies (acks, closes) to a third party's endpoint
                self._refuse(len(frame), f"{type(msg).__name__} names endpoint {reply_to}, sealed by {sender}")
                continue
            self._guard(lambda: self._on_message(msg))

    def _refuse(self, nbytes: int, reason: str) -> None:
        """Count and log a frame that failed authentication; it is dropped undecoded."""
        self.auth_refused += 1
        if time.monotonic() - self._refusal_logged_at >= _REFUSAL_LOG_PERIOD_S:
            logger.warning("kv %s: refused unauthenticated control frame (%d bytes): %s; %d refused in all",
                           self.role, nbytes, reason, self.auth_refused)
            self._refusal_logged_at = time.monotonic()

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - one bad event must not kill the control thread
            logger.exception("kv %s: control thread error", self.role)

    # ---------------------------------------------------------------- hooks
    @abstractmethod
    def abort(self, room: int, reason: str) -> None:
        """Fail the room here and tell the peer (from any thread)."""

    # hooks run on the control thread
    def _on_start(self) -> None:
        pass

    @abstractmethod
    def _on_message(self, msg: m.ControlMessage) -> None: ...

    def _on_tick(self) -> None:
        pass

    def _wants_fast_poll(self) -> bool:
        """True while waiting for engine notifications: the loop then polls every millisecond."""
        return False

    @abstractmethod
    def _on_timer(self, now: float) -> None: ...

    # ----------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the threads, close the sockets, deregister memory and release the engine."""
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_extra()
        for sock in self._push.values():
            sock.close(0)
        self._pull.close(0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for addr in self._registered:
            try:
                self.engine.deregister(addr)
            except Exception as e:  # noqa: BLE001
                logger.warning("kv %s: deregister %#x: %s", self.role, addr, e)
        self._registered.clear()
        self.engine.close()

    def _close_extra(self) -> None:
        pass
