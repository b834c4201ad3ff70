"""The one config of the KV transfer layer: backend, addresses, timeouts, heartbeat.

Frozen and validated; ``ServerConfig`` holds one and the engine CLI's
``--disaggregation-*`` flags take their defaults from these fields. Light to
import (no torch): the server's main process validates it before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.engine.net_allowlist import is_loopback, parse_allowlist
from pdserve.engine.kv_auth import FrameAuth, load_secret
from pdserve.engine.transfer_backends import check_transfer_backend
from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS

DEFAULT_BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class KVTransferConfig:
    # --disaggregation-transfer-backend: a name of TRANSFER_ENGINES, or an importable
    # "module:attr" factory (host, ib_device) -> TransferEngine, e.g. a test's fault-injecting wrapper
    backend: str = "mooncake"
    host: str = "127.0.0.1"  # this rank's address for the control channel and the transfer engine
    ib_device: str = ""  # --disaggregation-ib-device; non-empty selects RDMA for mooncake
    control_port: int = 0  # ZMQ control channel; 0 picks a free port
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT  # --disaggregation-bootstrap-port (prefill servers)
    bootstrap_timeout: float = 300.0  # sender with no destination fails after this
    waiting_timeout: float = 300.0  # receiver with no result this long after sending its metadata fails
    # a room failed after its destination went to the prefill keeps its pages (and aux slot) out of
    # the free list until the prefill's RoomClosed says no write of it is left, or this long; longer
    # than waiting_timeout's default, since a write can sit in a stalled link's TCP buffers that long;
    # a prefill known dead (bootstrap registration gone) releases them sooner (DecodeKVManager)
    quarantine_timeout: float = 600.0
    heartbeat_interval: float = 5.0  # decode -> each known prefill rank
    heartbeat_max_failures: int = 2  # heartbeats sent and unanswered in a row before the peer is declared dead
    num_transfer_threads: int = 2  # prefill workers; rooms are sharded over them, keeping per-room order
    # --disaggregation-layerwise (prefill servers): write each layer's KV as soon as the forward stored
    # it, so only the last layer's transfer follows the compute (kvtransfer/layer_signal.py); off: a
    # chunk's KV leaves after its whole forward. The decode side needs no flag: it is the same writes.
    layerwise: bool = False
    aux_num_slots: int = 256  # decode-side aux slots (first token, logprobs) = max rooms in flight
    aux_max_top_logprobs: int = MAX_TOP_LOGPROBS  # a slot holds any output's top logprobs
    # a file holding the shared secret of the KV control plane (ZMQ frames and bootstrap PUT /route
    # carry an HMAC made with it: engine/kv_auth.py); "" leaves the control plane unauthenticated,
    # which a PD server on a non-loopback host refuses unless allow_unauthenticated
    auth_key_file: str = ""
    # during a key rotation: the previous key, still accepted (frames are sealed with auth_key_file's)
    auth_previous_key_file: str = ""
    # run a PD server on a non-loopback host without a key (a private network that is trusted)
    allow_unauthenticated: bool = False
    # decode servers: the hosts or CIDRs a request's bootstrap_host may name (comma-separated);
    # "" allows any (a client calling a decode directly then chooses whom it fetches from)
    bootstrap_allowlist: str = ""

    def __post_init__(self):
        check_transfer_backend(self.backend)
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
        if self.auth_key_file:
            load_secret(self.auth_key_file)  # an unreadable or short key fails before any rank starts
        if self.auth_previous_key_file:
            if not self.auth_key_file:
                raise ValueError("auth_previous_key_file is a key still accepted during rotation: it needs "
                                 "auth_key_file (the current key)")
            load_secret(self.auth_previous_key_file)
        parse_allowlist(self.bootstrap_allowlist)  # a bad entry fails here, naming it
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

    def frame_auth(self, purpose: str) -> FrameAuth | None:
        """The authenticator of one channel (``control``: ZMQ frames, ``bootstrap``: PUT /route)
        from ``auth_key_file``; None when no key is configured."""
        if not self.auth_key_file:
            return None
        return FrameAuth.from_file(self.auth_key_file, purpose, self.auth_previous_key_file)

    def check_exposure(self, mode: str, host: str) -> None:
        """A prefill or decode server on a non-loopback ``host`` needs a key (or the explicit
        opt-out): ValueError naming both flags."""
        if mode in ("prefill", "decode") and not self.auth_key_file and not self.allow_unauthenticated \
                and not is_loopback(host):
            raise ValueError(f"a {mode} server on host {host!r} (not loopback) exposes the KV control plane: give "
                             "--disaggregation-auth-key-file (a shared secret of >= 32 bytes), or "
                             "--disaggregation-allow-unauthenticated on a trusted network")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
