"""NIXL (UCX backend) behind ``TransferEngine``; metadata travels over our control channel."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence

import numpy as np

from pdserve.engine import env
from pdserve.kvtransfer.errors import (
    ConnectError,
    EngineInitError,
    RegistrationError,
    TransferFailedError,
)
from pdserve.kvtransfer.engines.netdev import interface_of
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine, TransferHandle, TransferState

logger = logging.getLogger(__name__)
# how often the engine makes UCX progress on its own (see NixlTransferEngine.__init__); a write
# into this engine lands within about this long even while its owner polls nothing
PROGRESS_PERIOD_S = 0.0005


class NixlTransferEngine(TransferEngine):
    name = "nixl"
    supports_notifications = True

    def __init__(self, host: str, ib_device: str = ""):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:  # pragma: no cover - depends on the install
            raise EngineInitError(self.name, "import", None, f"nixl is not installed: {e}") from e
        # UCX opens a listener on every network interface unless told otherwise: bind it to the
        # interface of ``host`` (TCP only: with RDMA, UCX_NET_DEVICES must name the HCA port too,
        # so the operator sets it)
        device = None if ib_device or env.UCX_NET_DEVICES else interface_of(host)
        if device is not None:
            os.environ["UCX_NET_DEVICES"] = device
        # agent names must be unique among all peers that ever meet
        self.agent_name = f"pdserve-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # nixl's own progress thread is off: its Python agent runs it with no delay, a spin of about
        # half a core per agent (measured: 4 idle TP ranks of a prefill and a decode server took 180%
        # of this machine's 2 cores, and a 2-core TP stand over NIXL starved its own heartbeats).
        # UCX progresses inside the agent's calls instead; the thread below makes one every
        # PROGRESS_PERIOD_S, so a peer writing here progresses even while nobody polls this engine.
        try:
            self._agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:  # noqa: BLE001
            raise EngineInitError(self.name, "nixl_agent", None, str(e)) from e
        self._regs: dict[int, object] = {}
        self._peers: dict[bytes, str] = {}  # metadata -> agent name: connecting twice is a no-op
        # the agent's notification/transfer calls are not documented thread-safe
        self._lock = threading.Lock()
        self._notes: list[bytes] = []  # notifications the progress thread read, until get_notifications
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
        self._progress.start()

    def _progress_loop(self) -> None:
        while not self._stop.wait(PROGRESS_PERIOD_S):
            try:
                self._read_notes()
            except Exception as e:  # noqa: BLE001 - a closing agent; the next call reports real errors
                logger.debug("nixl progress: %s", e)

    def _read_notes(self) -> None:
        with self._lock:
            notifs = self._agent.get_new_notifs()  # progresses UCX's worker
            self._notes += [m for msgs in notifs.values() for m in msgs]

    @property
    def raw(self) -> object:
        """The nixl agent; hold ``lock`` around every call on it (the progress thread calls it too)."""
        return self._agent

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def register(self, addr: int, nbytes: int) -> None:
        try:
            with self._lock:
                self._regs[addr] = self._agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
        except Exception as e:  # noqa: BLE001
            raise RegistrationError(self.name, "register_memory", None, f"addr={addr:#x} nbytes={nbytes}: {e}") from e

    def deregister(self, addr: int) -> None:
        reg = self._regs.pop(addr, None)
        if reg is None:
            raise RegistrationError(self.name, "deregister_memory", None, f"addr={addr:#x} was not registered")
        try:
            with self._lock:
                self._agent.deregister_memory(reg)
        except Exception as e:  # noqa: BLE001
            raise RegistrationError(self.name, "deregister_memory", None, str(e)) from e

    def peer_info(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def connect(self, peer_info: bytes) -> str:
        if peer_info in self._peers:
            return self._peers[peer_info]
        try:
            with self._lock:
                name = self._agent.add_remote_agent(peer_info)
        except Exception as e:  # noqa: BLE001
            raise ConnectError(self.name, "add_remote_agent", None, str(e)) from e
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[peer_info] = name
        return name

    def disconnect(self, peer: str) -> None:
        self._peers = {md: name for md, name in self._peers.items() if name != peer}
        try:
            with self._lock:
                self._agent.remove_remote_agent(peer)
        except Exception as e:  # noqa: BLE001
            logger.warning("nixl remove_remote_agent(%s): %s", peer, e)

    def retire_peer(self, peer_info: bytes) -> bool:
        # removing the remote agent invalidates its metadata and closes this agent's UCX endpoints
        # to it; a peer that is not known here (never connected back) has no endpoint to close
        name = self._peers.get(peer_info)
        if name is not None:
            self.disconnect(name)
        return True

    def write_batch(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        notify: bytes | None = None,
    ) -> TransferHandle:
        n = len(src)
        nbytes = int(sum(lengths))
        # [n, 3] (addr, len, device id): numpy avoids building n Python tuples per side
        local = np.zeros((n, 3), dtype=np.uint64)
        remote = np.zeros((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1] = src, lengths
        remote[:, 0], remote[:, 1] = dst, lengths
        try:
            with self._lock:
                ld = self._agent.get_xfer_descs(local, "DRAM")
                rd = self._agent.get_xfer_descs(remote, "DRAM")
                xfer = self._agent.initialize_xfer("WRITE", ld, rd, peer, notify or b"")
                state = self._agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            raise TransferFailedError(self.name, "initialize_xfer/transfer", None, f"to {peer}: {e}") from e
        handle = TransferHandle(xfer, nbytes)
        if state == "ERR":
            self._release(handle)
            raise TransferFailedError(self.name, "transfer", None, f"to {peer}: posting {n} descriptors failed")
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        try:
            with self._lock:
                s = self._agent.check_xfer_state(handle.raw)
        except Exception as e:  # noqa: BLE001
            s, msg = "ERR", str(e)
        else:
            msg = "transfer reported ERR"
        if s == "PROC":
            return TransferState.PENDING
        if s == "DONE":
            handle.state = TransferState.DONE
        else:
            handle.error = TransferFailedError(self.name, "check_xfer_state", None, msg)
            handle.state = TransferState.FAILED
        self._release(handle)
        return handle.state

    def _release(self, handle: TransferHandle) -> None:
        try:
            with self._lock:
                self._agent.release_xfer_handle(handle.raw)
        except Exception as e:  # noqa: BLE001
            logger.warning("nixl release_xfer_handle: %s", e)

    def get_notifications(self) -> list[bytes]:
        self._read_notes()
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

    def close(self) -> None:
        self._stop.set()
        self._progress.join()
        for addr in list(self._regs):
            try:
                self.deregister(addr)
            except Exception as e:  # noqa: BLE001
                logger.warning("nixl close: %s", e)
