"""pdserve.kvtransfer: KV page transfer between prefill and decode ranks.

Scheduler-facing API (all non-blocking, driven by polling)::

    mgr = PrefillKVManager(cfg, pool, bootstrap_port).start()
    sender = mgr.create_sender(room); sender.poll(); sender.send(pages, is_last, aux)

    mgr = DecodeKVManager(cfg, pool).start()
    r = mgr.create_receiver(room, bootstrap_host, bootstrap_port, dp_rank)
    r.init(dst_pages, mgr.aux_pool.alloc()); r.poll(); r.aux()
"""

from pdserve.kvtransfer.aux_pool import AuxData, AuxPool
from pdserve.kvtransfer.bootstrap_server import DEFAULT_BOOTSTRAP_PORT, BootstrapServer
from pdserve.kvtransfer.config import TRANSFER_BACKENDS, KVTransferConfig
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
    "AuxData", "AuxPool", "BootstrapServer", "ConnectError", "DEFAULT_BOOTSTRAP_PORT", "DecodeKVManager",
    "EngineInitError", "KVPoll", "KVReceiver", "KVSender", "KVTransferConfig", "KVTransferError",
    "PrefillKVManager", "RegistrationError", "TRANSFER_BACKENDS", "TRANSFER_ENGINES",
    "TransferEngine", "TransferEngineError", "TransferFailedError", "TransferHandle", "TransferState",
    "create_transfer_engine",
]
