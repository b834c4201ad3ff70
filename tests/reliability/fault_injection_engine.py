"""A test-only transfer engine that fails a chosen fraction of writes at the adapter boundary.

It lives with the tests, not in the package: a server uses it through the transfer-backend
registry's external spec, ``--disaggregation-transfer-backend fault_injection_engine:faulty_mooncake``,
with this folder on ``PYTHONPATH`` (the server and its spawned scheduler ranks import it by name).
Each batch write then fails with ``TransferFailedError`` with probability ``RATE`` (seeded, so a
run is repeatable), exactly as a failed RDMA/TCP write would: the room fails on both sides with
the error in its message and its pages are freed. Everything else (register, connect,
notifications, the wire name ``mooncake``) goes to the wrapped engine unchanged, so a decode
server on plain ``mooncake`` pairs with it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

from pdserve.kvtransfer.errors import TransferFailedError
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine, TransferHandle, TransferState, create_transfer_engine

INJECTED = "injected transfer fault"
RATE, SEED = 0.4, 7  # of the external spec ``faulty_mooncake``


class FaultInjectingEngine(TransferEngine):
    """Wraps ``inner``; fails each ``write_batch``/``write`` with probability ``rate``."""

    def __init__(self, inner: TransferEngine, rate: float, seed: int = 0):  # noqa: D107 - no super(): a wrapper
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault injection rate must be in [0, 1], got {rate}")
        self.inner = inner
        self.rate = rate
        self.name = inner.name
        self.supports_notifications = inner.supports_notifications
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # transfer threads draw concurrently
        self.injected = 0  # faults injected so far (tests read it)

    def _draw(self, peer: str, n: int) -> TransferFailedError | None:
        with self._lock:
            if self._rng.random() >= self.rate:
                return None
            self.injected += 1
        return TransferFailedError(self.name, "batch write", None, f"{INJECTED} on {n} descriptors to {peer}")

    @property
    def raw(self) -> object:
        return self.inner.raw

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        self.inner.register(addr, nbytes, device)

    def deregister(self, addr: int) -> None:
        self.inner.deregister(addr)

    def peer_info(self) -> bytes:
        return self.inner.peer_info()

    def connect(self, peer_info: bytes) -> str:
        return self.inner.connect(peer_info)

    def disconnect(self, peer: str) -> None:
        self.inner.disconnect(peer)

    def retire_peer(self, peer_info: bytes) -> bool:
        return self.inner.retire_peer(peer_info)

    def write_batch(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
                    notify: bytes | None = None) -> TransferHandle:
        error = self._draw(peer, len(src))
        if error is None:
            return self.inner.write_batch(peer, src, dst, lengths, notify)
        handle = TransferHandle(None, sum(lengths))
        handle.state, handle.error = TransferState.FAILED, error
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.raw is None and handle.error is not None:
            return TransferState.FAILED
        return self.inner.poll(handle)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              notify: bytes | None = None) -> None:
        error = self._draw(peer, len(src))
        if error is not None:
            raise error
        self.inner.write(peer, src, dst, lengths, notify)

    def get_notifications(self) -> list[bytes]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()


def faulty_mooncake(host: str, ib_device: str = "") -> FaultInjectingEngine:
    """Transfer-backend factory (``fault_injection_engine:faulty_mooncake``): Mooncake failing ``RATE`` of writes."""
    return FaultInjectingEngine(create_transfer_engine("mooncake", host, ib_device), RATE, SEED)
