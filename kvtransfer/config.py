"""The one config of the KV transfer layer: backend, addresses, timeouts, heartbeat.

Frozen and validated; the engine CLI takes its defaults from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS

TRANSFER_BACKENDS = ("mooncake", "nixl")
DEFAULT_BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class KVTransferConfig:
    backend: str = "mooncake"  # --disaggregation-transfer-backend
    host: str = "127.0.0.1"  # this rank's address for the control channel and the transfer engine
    ib_device: str = ""  # --disaggregation-ib-device; non-empty selects RDMA for mooncake
    control_port: int = 0  # ZMQ control channel; 0 picks a free port
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT  # --disaggregation-bootstrap-port (prefill servers)
    bootstrap_timeout: float = 300.0  # sender with no destination fails after this
    waiting_timeout: float = 300.0  # receiver with no result this long after sending its metadata fails
    # a room failed after its destination went to the prefill keeps its pages (and aux slot) out of
    # the free list until the prefill's RoomClosed says no write of it is left, or this long; longer
    # than waiting_timeout's default, since a write can sit in a stalled link's TCP buffers that long
    quarantine_timeout: float = 600.0
    heartbeat_interval: float = 5.0  # decode -> each known prefill rank
    heartbeat_max_failures: int = 2  # missed replies in a row before the peer is declared dead
    num_transfer_threads: int = 2  # prefill workers; rooms are sharded over them, keeping per-room order
    aux_num_slots: int = 256  # decode-side aux slots (first token, logprobs) = max rooms in flight
    aux_max_top_logprobs: int = MAX_TOP_LOGPROBS  # a slot holds any output's top logprobs
    # test-only: fail this fraction of KV writes at the adapter boundary (kvtransfer/fault_injection.py)
    fault_injection_rate: float = 0.0
    fault_injection_seed: int = 0

    def __post_init__(self):
        if self.backend not in TRANSFER_BACKENDS:
            raise ValueError(f"backend must be one of {TRANSFER_BACKENDS}, got {self.backend!r}")
        if not self.host:
            raise ValueError("host must be a non-empty address")
        for name in ("control_port", "bootstrap_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("bootstrap_timeout", "waiting_timeout", "quarantine_timeout", "heartbeat_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("heartbeat_max_failures", "num_transfer_threads", "aux_num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.fault_injection_rate <= 1.0:
            raise ValueError(f"fault_injection_rate must be in [0, 1], got {self.fault_injection_rate}")
        if self.aux_max_top_logprobs < 0:
            raise ValueError(f"aux_max_top_logprobs must be >= 0, got {self.aux_max_top_logprobs}")

    @property
    def protocol(self) -> str:
        """Mooncake's transport: RDMA when an IB device is named, else TCP."""
        return "rdma" if self.ib_device else "tcp"

    @property
    def heartbeat_window(self) -> float:
        """Seconds without a heartbeat reply after which a prefill peer counts as dead."""
        return self.heartbeat_interval * self.heartbeat_max_failures

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
