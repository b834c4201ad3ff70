"""Mooncake Transfer Engine behind ``TransferEngine``: P2P handshake, TCP or RDMA."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.kvtransfer.errors import (
    ConnectError,
    EngineInitError,
    RegistrationError,
    TransferFailedError,
)
from pdserve.kvtransfer.transfer_engine import TransferEngine, TransferHandle, TransferState

logger = logging.getLogger(__name__)


class MooncakeTransferEngine(TransferEngine):
    name = "mooncake"
    supports_notifications = False

    def __init__(self, host: str, ib_device: str = ""):
        try:
            from mooncake.engine import TransferEngine as _Engine
        except ImportError as e:  # pragma: no cover - depends on the install
            raise EngineInitError(self.name, "import", None, f"mooncake is not installed: {e}") from e
        self._engine = _Engine()
        protocol = "rdma" if ib_device else "tcp"
        # P2PHANDSHAKE: no metadata server; peers are addressed as host:rpc_port
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device)
        if rc != 0:
            raise EngineInitError(self.name, "initialize", rc, f"host={host} protocol={protocol} device={ib_device!r}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        # get_batch_transfer_status blocks (GIL released) until a batch ends; these
        # threads do that waiting so write_batch stays non-blocking
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-wait")
        self._lock = threading.Lock()
        self._closed = False

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(addr, nbytes)
        if rc != 0:
            raise RegistrationError(self.name, "register_memory", rc, f"addr={addr:#x} nbytes={nbytes}")

    def deregister(self, addr: int) -> None:
        rc = self._engine.unregister_memory(addr)
        if rc != 0:
            raise RegistrationError(self.name, "unregister_memory", rc, f"addr={addr:#x}")

    def peer_info(self) -> bytes:
        return self.session_id.encode()

    def connect(self, peer_info: bytes) -> str:
        session = peer_info.decode(errors="replace")
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise ConnectError(self.name, "connect", None, f"bad session id {session!r}")
        # the segment is opened lazily by the first write
        return session

    def disconnect(self, peer: str) -> None:
        # mooncake caches the segment handle per session; nothing to release from Python
        pass

    def write_batch(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> TransferHandle:
        nbytes = int(sum(lengths))
        if not len(src):
            handle = TransferHandle(None, 0)
            handle.state = TransferState.DONE
            return handle
        batch_id = self._engine.batch_transfer_async_write(peer, list(src), list(dst), list(lengths))
        if batch_id <= 0:
            raise TransferFailedError(
                self.name, "batch_transfer_async_write", batch_id, f"to {peer}: {len(src)} descriptors, {nbytes} bytes"
            )
        fut: Future = self._waiters.submit(self._engine.get_batch_transfer_status, [batch_id])
        return TransferHandle((fut, peer), nbytes)

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        fut, peer = handle.raw
        if not fut.done():
            return TransferState.PENDING
        return self._finish(handle, fut, peer)

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        fut, peer = handle.raw
        try:
            fut.result(timeout)
        except TimeoutError:
            return TransferState.PENDING
        except Exception:
            pass  # _finish records it
        return self._finish(handle, fut, peer)

    def _finish(self, handle: TransferHandle, fut: Future, peer: str) -> TransferState:
        try:
            rc = fut.result()
        except Exception as e:  # noqa: BLE001 - the binding may raise anything
            rc, msg = None, repr(e)
        else:
            msg = f"to {peer}: {handle.nbytes} bytes"
        if rc == 0:
            handle.state = TransferState.DONE
        else:
            handle.error = TransferFailedError(self.name, "get_batch_transfer_status", rc, msg)
            handle.state = TransferState.FAILED
        return handle.state

    def get_notifications(self) -> list[bytes]:
        return []

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._waiters.shutdown(wait=False, cancel_futures=True)
