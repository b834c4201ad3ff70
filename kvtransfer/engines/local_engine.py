"""``local``: a transfer engine between registered memory regions of one process.

It follows Mooncake and NIXL where the layers above can tell: the same descriptors
(raw source and destination addresses with lengths), the same handle states, per-room
notifications after the data (as NIXL), and typed errors on the same failure paths: an
unregistered region, an unknown or closed peer. The bytes are copied at ``write_batch``
(``ctypes.memmove``), so a write is DONE as soon as it returns. It makes the prefill and
decode loops testable in one process in milliseconds (``tests/prefill``, ``tests/decode``).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import uuid
import weakref
from collections.abc import Sequence

from pdserve.kvtransfer.errors import ConnectError, RegistrationError, TransferFailedError
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine, TransferHandle, TransferState

# the process is the fabric: peers find each other here by name (weak: a dropped engine leaves)
_ENGINES: "weakref.WeakValueDictionary[str, LocalTransferEngine]" = weakref.WeakValueDictionary()


class LocalTransferEngine(TransferEngine):
    name = "local"
    supports_notifications = True

    def __init__(self, host: str, ib_device: str = ""):
        self.peer_name = f"local-{host}-{uuid.uuid4().hex[:8]}"
        self._regions: dict[int, int] = {}  # base address -> bytes
        self._notes: list[bytes] = []
        self._lock = threading.Lock()  # transfer threads write while the control thread reads notes
        # held by a peer's write while it copies into this engine's memory; retire_peer takes it, so
        # once a peer is retired none of its copies is running or can start
        self._inbound = threading.Lock()
        self._retired: set[str] = set()
        self.closed = False
        _ENGINES[self.peer_name] = self

    @property
    def raw(self) -> object:
        return self

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        if addr <= 0 or nbytes <= 0 or addr in self._regions:
            raise RegistrationError(self.name, "register", None, f"addr={addr:#x} nbytes={nbytes}")
        self._regions[addr] = nbytes

    def deregister(self, addr: int) -> None:
        if self._regions.pop(addr, None) is None:
            raise RegistrationError(self.name, "deregister", None, f"addr={addr:#x} was not registered")

    def peer_info(self) -> bytes:
        return self.peer_name.encode()

    def connect(self, peer_info: bytes) -> str:
        name = peer_info.decode(errors="replace")
        if name not in _ENGINES:
            raise ConnectError(self.name, "connect", None, f"no local engine {name!r} in this process")
        return name

    def disconnect(self, peer: str) -> None:
        pass  # nothing is cached per peer; a later write looks the peer up again

    def retire_peer(self, peer_info: bytes) -> bool:
        with self._inbound:
            self._retired.add(peer_info.decode(errors="replace"))
        return True

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies inside one registered region."""
        return any(base <= addr and addr + nbytes <= base + size for base, size in self._regions.items())

    def write_batch(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> TransferHandle:
        handle = TransferHandle(None, int(sum(lengths)))
        target = _ENGINES.get(peer)
        with target._inbound if target is not None else contextlib.nullcontext():
            error = self._check(peer, src, dst, lengths)
            if error is None:
                for s, d, n in zip(src, dst, lengths):
                    ctypes.memmove(d, s, n)
        if error is None:
            if notify is not None:
                target.deliver(notify)
            handle.state = TransferState.DONE
        else:
            handle.error, handle.state = TransferFailedError(self.name, "batch write", -1, error), TransferState.FAILED
        return handle

    def _check(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> str | None:
        if self.closed:
            return "engine closed"
        target = _ENGINES.get(peer)
        if target is None or target.closed:
            return f"peer {peer} is gone"
        if self.peer_name in target._retired:
            return f"peer {peer} retired this engine's connection"
        if not len(src) == len(dst) == len(lengths):
            return f"{len(src)} sources, {len(dst)} destinations, {len(lengths)} lengths"
        for s, d, n in zip(src, dst, lengths):
            if not self.covers(s, n):
                return f"source {s:#x}+{n} is not registered here"
            if not target.covers(d, n):
                return f"destination {d:#x}+{n} is not registered at {peer}"
        return None

    def deliver(self, note: bytes) -> None:
        """A peer's notification, after its data landed."""
        with self._lock:
            self._notes.append(note)

    def poll(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def get_notifications(self) -> list[bytes]:
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def close(self) -> None:
        self.closed = True
        _ENGINES.pop(self.peer_name, None)
