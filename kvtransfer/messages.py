"""Every message of the KV transfer layer, as msgspec Structs.

Control channel (ZMQ, msgpack, tagged union ``ControlMessage``):
  decode -> prefill: ``RegisterPool`` once per pair, ``RoomRequest`` per room, ``Heartbeat``;
  prefill -> decode: ``RegisterAck``, ``RoomStatus``, ``RoomClosed``, ``HeartbeatAck``;
  either way: ``AbortRoom``.
Bootstrap server (HTTP, JSON): ``RankRegistration`` in, ``RankRoute``/``Topology`` out.
NIXL engine (inside ``RegisterPool.peer_info``, msgpack): ``NixlPeerInfo``.

KV destinations cross the wire as page indices only; the prefill side turns them
into addresses with the pool it validated at registration.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.quantization_names import UNQUANTIZED


MHA, LATENT = "mha", "latent"  # KVLayout.kind (page_pool), named here without importing torch
KV_KINDS = (MHA, LATENT)


class LayoutInfo(msgspec.Struct, frozen=True):
    """Wire form of ``engine.page_pool.KVLayout``."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    quantization: str = UNQUANTIZED  # the weights' (KVLayout.quantization); a peer that predates it sends none
    model: str = ""  # the model's identity (KVLayout.model: architecture, weights fingerprint, dtype, quantization)
    # KVLayout.kind: "mha" (K and V per head) or "latent" (MLA: one latent vector per token, K buffers only,
    # identical on every TP rank); a peer that predates it sends none (it is "mha")
    kind: str = "mha"

    @classmethod
    def from_layout(cls, layout) -> "LayoutInfo":
        return cls(layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype,
                   layout.quantization, layout.model, layout.kind)

    def describe(self) -> str:
        """The layout in a line, as a refusal names it: ``latent 1x576 bfloat16``."""
        return f"{self.kind} {self.num_kv_heads}x{self.head_dim} {self.dtype}"

    def mismatch(self, other: "LayoutInfo") -> str | None:
        """``None`` when equal, else which fields differ, e.g. ``page_size: 16 vs 32``."""
        diffs = [
            f"{f}: {getattr(self, f)} vs {getattr(other, f)}"
            for f in self.__struct_fields__
            if getattr(self, f) != getattr(other, f)
        ]
        return "; ".join(diffs) or None


# --------------------------------------------------------------- control channel
class RegisterPool(msgspec.Struct, frozen=True, tag=True):
    """decode -> prefill, once per (decode rank, prefill rank) pair."""

    decode_id: str  # unique per decode manager instance
    endpoint: str  # decode's control endpoint, tcp://host:port
    backend: str
    peer_info: bytes  # transfer engine session id / agent metadata
    layout: LayoutInfo
    num_pages: int
    page_bytes: int  # bytes of one page of one layer's K (or V)
    k_addrs: list[int]  # per layer, address of page 0
    v_addrs: list[int]
    aux_addr: int
    aux_slot_bytes: int
    aux_num_slots: int
    # tensor parallel: this decode pool is TP rank tp_rank of tp_size over a model of kv_heads KV heads
    # (0: the layout's own count, TP 1); the prefill cuts its page runs by head range when sizes differ
    tp_rank: int = 0
    tp_size: int = 1
    kv_heads: int = 0
    # of aux_slot_bytes, the room a NEXTN decode keeps for the prompt's last hidden state (aux_pool.py)
    aux_hidden_bytes: int = 0


class RegisterAck(msgspec.Struct, frozen=True, tag=True):
    """prefill -> decode: the pool was accepted (ok) or why not."""

    prefill_id: str
    endpoint: str  # prefill's control endpoint, as in its bootstrap registration
    ok: bool
    reason: str = ""
    peer_info: bytes = b""


class RoomRequest(msgspec.Struct, frozen=True, tag=True):
    """decode -> prefill: where a room's KV goes."""

    room: int
    decode_id: str
    dst_pages: list[int]
    aux_slot: int
    # leading pages of the prompt the decode already holds (its prefix cache): the prefill sends
    # only the pages after them, into dst_pages (SGLang's decode radix cache in PD)
    held_pages: int = 0
    # the LoRA adapter the decode runs the room under, as its prefix-cache namespace (lora_names.lora_id_of;
    # 0: the base model): a prefill that computed the KV under another refuses the room
    lora_id: int = 0


class RoomStatus(msgspec.Struct, frozen=True, tag=True):
    """prefill -> decode: the room's KV and aux have landed, or failed with a reason."""

    room: int
    success: bool
    reason: str = ""
    notified: bool = False  # an engine notification for the room follows the data (nixl)
    tp_rank: int = 0  # the prefill TP rank whose slices these are (a decode rank may have several sources)
    # seconds from the end of the room's prefill compute to this status (the prefill's share of the
    # exposed transfer time; kvtransfer/room_metrics.py)
    exposed_s: float = 0.0


class AbortRoom(msgspec.Struct, frozen=True, tag=True):
    """Either way: stop the room; the receiver of this fails it with ``reason``."""

    room: int
    reason: str
    endpoint: str = ""  # the sender's control endpoint (decode -> prefill: where RoomClosed goes)
    tp_rank: int = 0  # prefill -> decode: the prefill TP rank that aborted


class RoomClosed(msgspec.Struct, frozen=True, tag=True):
    """prefill -> decode: a failed or aborted room has no KV write queued or in flight here any more.

    Sent once per room after ``AbortRoom`` (either way) or a prefill-side failure, when its last
    queued chunk was dropped or its last write returned; until then the decode keeps the room's
    pages out of its free list (a write still in flight would land in them)."""

    room: int
    tp_rank: int = 0  # the prefill TP rank that closed it


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """decode -> prefill, every ``heartbeat_interval``."""

    decode_id: str
    endpoint: str
    seq: int


class HeartbeatAck(msgspec.Struct, frozen=True, tag=True):
    prefill_id: str
    endpoint: str
    seq: int


ControlMessage = (
    RegisterPool | RegisterAck | RoomRequest | RoomStatus | RoomClosed | AbortRoom | Heartbeat | HeartbeatAck
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode(msg: ControlMessage) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> ControlMessage:
    """Raises ``msgspec.DecodeError`` (or ``ValidationError``) on garbage or truncated frames."""
    return _decoder.decode(frame)


# -------------------------------------------------------------- bootstrap server
class RankRegistration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``PUT /route`` body: a prefill scheduler rank announces itself."""

    dp_rank: int
    tp_rank: int
    endpoint: str  # host:port of its control channel
    page_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    backend: str = "mooncake"
    tp_size: int = 1  # the prefill server's TP size
    kv_heads: int = 0  # the model's KV heads (0: num_kv_heads, TP 1); num_kv_heads is this rank's share
    quantization: str = UNQUANTIZED  # the weights' (as in LayoutInfo)
    model: str = ""  # the model's identity (as in LayoutInfo)
    kv_kind: str = MHA  # LayoutInfo.kind

    def layout(self) -> LayoutInfo:
        return LayoutInfo(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.kv_dtype,
                          self.quantization, self.model, self.kv_kind)


class Topology(msgspec.Struct, frozen=True):
    """``GET /route``: every rank, once all expected ones registered."""

    dp_size: int
    tp_size: int
    ranks: list[RankRegistration]


class NixlPeerInfo(msgspec.Struct, frozen=True):
    """The NIXL engine's ``peer_info``: its agent's metadata, and where each region it registered
    lives, so that a peer writing into it names each destination with its memory type and device
    (``"VRAM"`` and the CUDA device's index, ``"DRAM"`` and 0: ``engines/nixl_memory.py``)."""

    metadata: bytes
    regions: list[tuple[int, int, str, int]] = []  # (address, length, memory type, device id)
