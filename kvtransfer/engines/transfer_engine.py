"""One small interface over the raw transfer engines (Mooncake, NIXL, and ``local`` in one process).

The raw engines take raw pointers and return integer codes or strings; this is
the one place they are wrapped. Everything above talks to ``TransferEngine`` and
gets ``TransferEngineError`` subclasses, never a bare ``-1``.
"""

from __future__ import annotations

import enum
import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from pdserve.engine.transfer_backends import TRANSFER_ENGINES, check_transfer_backend, load_transfer_factory
from pdserve.kvtransfer.errors import EngineInitError, TransferEngineError


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """An in-flight batch write. ``error`` is set once it has failed."""

    __slots__ = ("raw", "nbytes", "error", "state")

    def __init__(self, raw: object, nbytes: int):
        self.raw = raw
        self.nbytes = nbytes
        self.error: TransferEngineError | None = None
        self.state = TransferState.PENDING


class TransferEngine(ABC):
    """A transfer engine bound to this host. Thread-safe for concurrent writes."""

    name: str = ""
    #: True when ``write_batch(notify=...)`` delivers a message to the peer after the data
    supports_notifications: bool = False

    @abstractmethod
    def __init__(self, host: str, ib_device: str = ""):
        """Start the engine on ``host`` (RDMA on ``ib_device`` where the backend supports it)."""

    @property
    @abstractmethod
    def raw(self) -> object:
        """The wrapped engine object (mooncake ``TransferEngine``, ``nixl_agent``), for baselines."""

    @abstractmethod
    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        """Register ``[addr, addr + nbytes)`` so it can be a source or destination of writes.
        ``device``: where the region lives, in torch's spelling (``"cpu"``, ``"cuda:N"``); a
        backend that names memory by its kind takes it from there (NIXL: ``"VRAM"`` or ``"DRAM"``)."""

    @abstractmethod
    def deregister(self, addr: int) -> None:
        """Undo ``register`` for the region starting at ``addr``."""

    @abstractmethod
    def peer_info(self) -> bytes:
        """What a peer needs to ``connect`` to this engine (session id, agent metadata)."""

    @abstractmethod
    def connect(self, peer_info: bytes) -> str:
        """Make a peer known from its ``peer_info``; returns the peer name for ``write_batch``."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer (e.g. it died); a later ``connect`` may bring it back."""

    def retire_peer(self, peer_info: bytes) -> bool:
        """Tear down every connection with the (dead) peer that ``peer_info`` names, so that no write
        of it can land in this engine's memory after this returns; True when the backend can promise
        that. The default cannot (False): the caller then relies on the peer's process exit, which
        closes its connections, plus a linger (``DecodeKVManager``)."""
        return False

    @abstractmethod
    def write_batch(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> TransferHandle:
        """Start writing each ``lengths[i]`` bytes at local ``src[i]`` to the peer's ``dst[i]``.

        Returns at once; ``poll`` or ``wait`` the handle. ``notify`` (backends with
        ``supports_notifications``) reaches the peer once all bytes have landed.
        """

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking state of a write; on FAILED, ``handle.error`` says why."""

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferState:
        """Block until the write is DONE or FAILED (or ``timeout`` passes: PENDING)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        start = time.monotonic()
        while (state := self.poll(handle)) is TransferState.PENDING:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return state
            # sleep(0) releases the GIL but keeps this thread runnable: a busy host must not
            # add a scheduling delay to short writes; long ones back off to spare the CPU
            time.sleep(0 if now - start < 0.005 else 1e-4)
        return state

    def write(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> None:
        """Blocking ``write_batch`` for worker threads; raises ``TransferEngineError`` on failure."""
        handle = self.write_batch(peer, src, dst, lengths, notify)
        if self.wait(handle) is not TransferState.DONE:
            raise handle.error

    @abstractmethod
    def get_notifications(self) -> list[bytes]:
        """Notifications that arrived since the last call (empty for backends without them)."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine; no call is valid afterwards."""


def import_backend(engine: str, module: str):
    """The raw engine's Python ``module``; EngineInitError naming ``engine`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise EngineInitError(engine, "import", None, f"{module.partition('.')[0]} is not installed: {e}") from e


def create_transfer_engine(name: str, host: str, ib_device: str = "") -> TransferEngine:
    """Build the engine registered as ``name``, or made by the ``module:attr`` factory ``name``."""
    check_transfer_backend(name)
    return load_transfer_factory(TRANSFER_ENGINES.get(name, name))(host, ib_device)
