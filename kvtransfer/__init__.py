"""pdserve.kvtransfer: KV page transfer between prefill and decode ranks.

Scheduler-facing API (all non-blocking, driven by polling from the scheduler loop)::

    # prefill server: one bootstrap server, one manager per scheduler rank
    BootstrapServer(host, port, dp_size).start_in_thread()   # or: await server.start()
    mgr = PrefillKVManager(cfg, pool, bootstrap_port, dp_rank=r).start()
    sender = mgr.create_sender(room)
    sender.poll()                          # Bootstrapping -> WaitingForInput: run the prefill
    sender.send(pages, is_last, aux)       # per chunk; aux (first token, logprobs) with the last
    sender.poll()                          # Transferring -> Success | Failed (sender.failure_reason)

    # decode server: one manager per scheduler rank
    mgr = DecodeKVManager(cfg, pool).start()
    r = mgr.create_receiver(room, bootstrap_host, bootstrap_port, prefill_dp_rank)
    r.poll()                               # Bootstrapping -> WaitingForInput
    r.init(dst_pages, mgr.aux_pool.alloc())
    r.poll()                               # Transferring -> Success | Failed; then r.aux()
    mgr.abort(room, reason); mgr.close()

One room, step by step:
1. The decode manager looks up the prefill rank at its bootstrap server (``GET /route``,
   cached per rank) and checks page size, dtype and layout.
2. Once per pair it sends ``RegisterPool`` (buffer base addresses, engine peer info);
   the prefill rank validates it and answers ``RegisterAck``.
3. Per room the decode side sends ``RoomRequest`` (page indices and an aux slot only).
4. The prefill side's transfer thread merges page runs contiguous on both sides into one
   descriptor per layer per K/V, writes them (and the aux slot with the last chunk)
   through the engine, then sends ``RoomStatus``; with nixl the last write also carries a
   per-room notification, and the decode side waits for both.
5. ``AbortRoom`` either way fails the room on both sides; heartbeats from decode to each
   known prefill rank fail every open room of a peer that stops answering.
"""

from pdserve.kvtransfer.aux_pool import AuxData, AuxPool
from pdserve.kvtransfer.bootstrap_server import BootstrapServer
from pdserve.kvtransfer.config import DEFAULT_BOOTSTRAP_PORT, TRANSFER_BACKENDS, KVTransferConfig
from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager
from pdserve.kvtransfer.errors import (
    ConnectError,
    EngineInitError,
    KVTransferError,
    RegistrationError,
    TransferEngineError,
    TransferFailedError,
)
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.kv_receiver import KVReceiver
from pdserve.kvtransfer.kv_sender import KVSender
from pdserve.kvtransfer.prefill_kv_manager import PrefillKVManager
from pdserve.kvtransfer.transfer_engine import (
    TRANSFER_ENGINES,
    TransferEngine,
    TransferHandle,
    TransferState,
    create_transfer_engine,
)

__all__ = [
    "AuxData", "AuxPool", "DEFAULT_BOOTSTRAP_PORT", "BootstrapServer", "ConnectError", "DecodeKVManager",
    "EngineInitError", "KVPoll", "KVReceiver", "KVSender", "KVTransferConfig", "KVTransferError",
    "PrefillKVManager", "RegistrationError", "TRANSFER_BACKENDS", "TRANSFER_ENGINES",
    "TransferEngine", "TransferEngineError", "TransferFailedError", "TransferHandle", "TransferState",
    "create_transfer_engine",
]
