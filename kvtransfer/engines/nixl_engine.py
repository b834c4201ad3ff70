"""NIXL (UCX backend) behind ``TransferEngine``; metadata travels over our control channel.

Each region is registered in the memory it lives in (``"VRAM"`` with the CUDA device's index,
``"DRAM"`` with 0: ``nixl_memory.py``), and ``peer_info`` carries where each region lives
(``NixlPeerInfo``), so a writer names every destination in its peer's memory type and device. A
batch that spans places (KV pages on the GPU, the aux slot in host memory) is posted as one NIXL
transfer per pair of places; the notification rides the last one, posted once the others are done,
so it still reaches the peer after every byte.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence

import msgspec

from pdserve.engine import env
from pdserve.kvtransfer.errors import (
    ConnectError,
    EngineInitError,
    RegistrationError,
    TransferFailedError,
)
from pdserve.kvtransfer.engines.netdev import interface_of
from pdserve.kvtransfer.engines.nixl_memory import MemPlace, PlaceGroup, PlaceMap, place_of, split_by_place
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine, TransferHandle, TransferState, import_backend
from pdserve.kvtransfer.messages import NixlPeerInfo

logger = logging.getLogger(__name__)
# how often the engine makes UCX progress on its own (see NixlTransferEngine.__init__); a write
# into this engine lands within about this long even while its owner polls nothing
PROGRESS_PERIOD_S = 0.0005
# starts a ``NixlPeerInfo``; peer info without it is a bare agent metadata (host memory only)
PEER_INFO_MAGIC = b"pdserve-nixl/1\0"


def encode_peer_info(metadata: bytes, regions: list[tuple[int, int, MemPlace]]) -> bytes:
    rows = [(addr, nbytes, p.mem_type, p.dev_id) for addr, nbytes, p in regions]
    return PEER_INFO_MAGIC + msgspec.msgpack.encode(NixlPeerInfo(metadata, rows))


def decode_peer_info(peer_info: bytes) -> tuple[bytes, PlaceMap]:
    """``(agent metadata, places of the peer's regions)`` of a peer's ``peer_info``."""
    if not peer_info.startswith(PEER_INFO_MAGIC):
        return peer_info, PlaceMap()
    info = msgspec.msgpack.decode(peer_info[len(PEER_INFO_MAGIC):], type=NixlPeerInfo)
    return info.metadata, PlaceMap((a, n, MemPlace(mem, dev)) for a, n, mem, dev in info.regions)


class _Posting:
    """A batch's NIXL transfers: those in flight, and the last group, held back while it carries a
    notification and others are in flight."""

    __slots__ = ("peer", "in_flight", "held", "notify")

    def __init__(self, peer: str, held: PlaceGroup | None, notify: bytes):
        self.peer = peer
        self.in_flight: list[object] = []
        self.held = held
        self.notify = notify


class NixlTransferEngine(TransferEngine):
    name = "nixl"
    supports_notifications = True

    def __init__(self, host: str, ib_device: str = ""):
        nixl_api = import_backend(self.name, "nixl._api")
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
            self._agent = nixl_api.nixl_agent(
                self.agent_name, nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:  # noqa: BLE001
            raise EngineInitError(self.name, "nixl_agent", None, str(e)) from e
        self._regs: dict[int, tuple[object, int, MemPlace]] = {}  # addr -> (nixl registration, nbytes, place)
        self._local = PlaceMap()
        self._peer_places: dict[str, PlaceMap] = {}  # agent name -> where its regions live
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

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        try:
            place = place_of(device)
            with self._lock:
                reg = self._agent.register_memory([(addr, nbytes, place.dev_id, "")], place.mem_type)
        except Exception as e:  # noqa: BLE001
            raise RegistrationError(self.name, "register_memory", None,
                                    f"addr={addr:#x} nbytes={nbytes} device={device}: {e}") from e
        self._regs[addr] = (reg, nbytes, place)
        self._local = PlaceMap((a, n, p) for a, (_, n, p) in self._regs.items())

    def deregister(self, addr: int) -> None:
        entry = self._regs.pop(addr, None)
        if entry is None:
            raise RegistrationError(self.name, "deregister_memory", None, f"addr={addr:#x} was not registered")
        self._local = PlaceMap((a, n, p) for a, (_, n, p) in self._regs.items())
        try:
            with self._lock:
                self._agent.deregister_memory(entry[0])
        except Exception as e:  # noqa: BLE001
            raise RegistrationError(self.name, "deregister_memory", None, str(e)) from e

    def peer_info(self) -> bytes:
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return encode_peer_info(metadata, [(a, n, p) for a, (_, n, p) in self._regs.items()])

    def connect(self, peer_info: bytes) -> str:
        if peer_info in self._peers:
            return self._peers[peer_info]
        try:
            metadata, places = decode_peer_info(peer_info)
            with self._lock:
                name = self._agent.add_remote_agent(metadata)
        except Exception as e:  # noqa: BLE001
            raise ConnectError(self.name, "add_remote_agent", None, str(e)) from e
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[peer_info] = name
        self._peer_places[name] = places
        return name

    def disconnect(self, peer: str) -> None:
        self._peers = {md: name for md, name in self._peers.items() if name != peer}
        self._peer_places.pop(peer, None)
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
        groups = split_by_place(src, dst, lengths, self._local, self._peer_places.get(peer, PlaceMap()))
        # the notification rides the last group: with others in flight, it waits for them (poll)
        held = groups.pop() if notify and len(groups) > 1 else None
        posting = _Posting(peer, held, notify or b"")
        handle = TransferHandle(posting, int(sum(lengths)))
        try:
            for i, group in enumerate(groups):
                last = held is None and i == len(groups) - 1
                self._post(posting, group, posting.notify if last else b"")
        except TransferFailedError:
            self._release(handle)
            raise
        return handle

    def _post(self, posting: _Posting, group: PlaceGroup, notify: bytes) -> None:
        """Start one NIXL transfer of ``group``; TransferFailedError when it cannot start."""
        peer = posting.peer
        try:
            with self._lock:
                ld = self._agent.get_xfer_descs(group.local_descs, group.local.mem_type)
                rd = self._agent.get_xfer_descs(group.remote_descs, group.remote.mem_type)
                xfer = self._agent.initialize_xfer("WRITE", ld, rd, peer, notify)
                posting.in_flight.append(xfer)
                state = self._agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            raise TransferFailedError(self.name, "initialize_xfer/transfer", None, f"to {peer}: {e}") from e
        if state == "ERR":
            raise TransferFailedError(self.name, "transfer", None,
                                      f"to {peer}: posting {len(group.local_descs)} descriptors failed")

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        posting: _Posting = handle.raw
        error = None
        for xfer in list(posting.in_flight):
            try:
                with self._lock:
                    s = self._agent.check_xfer_state(xfer)
            except Exception as e:  # noqa: BLE001
                s, msg = "ERR", str(e)
            else:
                msg = "transfer reported ERR"
            if s == "PROC":
                continue
            if s != "DONE":
                error = TransferFailedError(self.name, "check_xfer_state", None, msg)
                break
            posting.in_flight.remove(xfer)
            self._release_xfer(xfer)
        if error is None and not posting.in_flight and posting.held is not None:
            group, posting.held = posting.held, None
            try:
                self._post(posting, group, posting.notify)
            except TransferFailedError as e:
                error = e
        if error is not None:
            handle.error = error
            handle.state = TransferState.FAILED
            self._release(handle)
        elif not posting.in_flight:
            handle.state = TransferState.DONE
        return handle.state

    def _release(self, handle: TransferHandle) -> None:
        posting: _Posting = handle.raw
        xfers, posting.in_flight, posting.held = posting.in_flight, [], None
        for xfer in xfers:
            self._release_xfer(xfer)

    def _release_xfer(self, xfer: object) -> None:
        try:
            with self._lock:
                self._agent.release_xfer_handle(xfer)
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
