"""Mooncake Transfer Engine behind ``TransferEngine``: P2P handshake, TCP or RDMA."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pdserve.kvtransfer.errors import (
    ConnectError,
    EngineInitError,
    RegistrationError,
    TransferFailedError,
)
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine, TransferHandle, TransferState, import_backend

logger = logging.getLogger(__name__)

# Mooncake's TCP lanes reject requests past a bounded queue ("queue-full
# rejection", seen at ~2k small descriptors in flight), failing the whole batch;
# so batches go in pieces, with at most _MAX_IN_FLIGHT pieces engine-wide.
MAX_DESCS_PER_BATCH = 512
_MAX_IN_FLIGHT = 2


class MooncakeTransferEngine(TransferEngine):
    name = "mooncake"
    supports_notifications = False

    def __init__(self, host: str, ib_device: str = ""):
        self._engine = import_backend(self.name, "mooncake.engine").TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        # P2PHANDSHAKE: no metadata server; peers are addressed as host:rpc_port
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device)
        if rc != 0:
            raise EngineInitError(self.name, "initialize", rc, f"host={host} protocol={protocol} device={ib_device!r}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        # get_batch_transfer_status blocks (GIL released) until a batch ends; these
        # threads do that waiting so write_batch stays non-blocking
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-wait")
        self._credits = threading.BoundedSemaphore(_MAX_IN_FLIGHT)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def raw(self) -> object:
        return self._engine

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
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

    def retire_peer(self, peer_info: bytes) -> bool:
        # Mooncake's Python API has no per-peer teardown (no call closes the inbound TCP session or
        # the RDMA QPs of one peer); the dead peer's process exit closed them, so the caller lingers
        return False

    def write_batch(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> TransferHandle:
        handle = TransferHandle(None, int(sum(lengths)))
        if not len(src):
            handle.state = TransferState.DONE
            return handle
        handle.raw = self._waiters.submit(self._write_sync, peer, list(src), list(dst), list(lengths))
        return handle

    def write(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> None:
        # already on a worker thread: write inline instead of hopping to a waiter thread
        rc, msg = self._write_sync(peer, list(src), list(dst), list(lengths))
        if rc != 0:
            raise TransferFailedError(self.name, "batch write", rc, msg)

    def _write_sync(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> tuple[int, str]:
        """Blocking: submit in sub-batches the TCP lanes' queues can hold; (rc, message)."""
        if not src:
            return 0, ""
        for i in range(0, len(src), MAX_DESCS_PER_BATCH):
            j = i + MAX_DESCS_PER_BATCH
            with self._credits:
                batch_id = self._engine.batch_transfer_async_write(peer, src[i:j], dst[i:j], lengths[i:j])
                if batch_id <= 0:  # 0 when the peer's segment cannot be opened
                    return batch_id or -1, f"batch_transfer_async_write to {peer}: {len(src[i:j])} descriptors refused"
                # blocks with the GIL released until the batch completes, fails or times out
                rc = self._engine.get_batch_transfer_status([batch_id])
            if rc != 0:
                return rc, f"get_batch_transfer_status: writing {sum(lengths[i:j])} bytes to {peer}"
        return 0, ""

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        if not handle.raw.done():
            return TransferState.PENDING
        return self._finish(handle)

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        try:
            handle.raw.result(timeout)
        except TimeoutError:
            return TransferState.PENDING
        except Exception:  # noqa: BLE001 - _finish records it
            pass
        return self._finish(handle)

    def _finish(self, handle: TransferHandle) -> TransferState:
        try:
            rc, msg = handle.raw.result()
        except Exception as e:  # noqa: BLE001 - the binding may raise anything
            rc, msg = None, repr(e)
        if rc == 0:
            handle.state = TransferState.DONE
        else:
            handle.error = TransferFailedError(self.name, "batch write", rc, msg)
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
