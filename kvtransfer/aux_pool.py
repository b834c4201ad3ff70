"""Slots of registered memory for a room's aux data: the first output token and its logprobs,
how many prompt tokens the prefill took from its cache, and, for a decode that drafts with
NEXTN, the target's hidden state at the last prompt position.

Prefill writes a room's ``AuxData`` straight into the decode rank's slot with the
last KV chunk. Slot layout (little-endian): ``u32 valid, i32 token_id, f32 logprob,
u32 n_top, u32 cached_tokens, u32 n_hidden, i32 top_ids[max_top], f32 top_logprobs[max_top],
u8 hidden[hidden_bytes]``. ``hidden_bytes`` is 0 unless the pool was made for NEXTN (the decode's
slots hold the hidden state it needs, the prefill's staging slots the one it sends); a slot's
``n_hidden`` says how many bytes of it were written, so a decode tells a prefill that sent none
(``n_hidden`` 0) from one that did. The bytes are opaque here (the model's dtype: ``nextn_handoff``).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS

_HEADER = struct.Struct("<IifIII")
_VALID = 0x5044_4158  # "PDAX": a slot never written reads as invalid


@dataclass(frozen=True)
class AuxData:
    token_id: int
    logprob: float = 0.0
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # prompt tokens the prefill did not compute (its prefix cache, any tier): the decode reports
    # them as the request's cached tokens, as a colocated server does
    cached_tokens: int = 0
    # NEXTN: the target's final-normed hidden state at the last prompt position, its raw bytes
    # (hidden_size values in the model's dtype); empty when the prefill sends none
    hidden: bytes = b""


def base_slot_bytes(max_top_logprobs: int) -> int:
    """A slot's bytes before its hidden state: the header and the top logprobs."""
    return _HEADER.size + 8 * max_top_logprobs


class AuxPool:
    def __init__(self, num_slots: int, max_top_logprobs: int = MAX_TOP_LOGPROBS, hidden_bytes: int = 0):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if hidden_bytes < 0:
            raise ValueError(f"hidden_bytes must be >= 0, got {hidden_bytes}")
        self.num_slots = num_slots
        self.max_top = max_top_logprobs
        self.hidden_bytes = hidden_bytes
        self.base_bytes = base_slot_bytes(max_top_logprobs)  # everything but the hidden state
        self.slot_bytes = self.base_bytes + hidden_bytes
        # buf: [num_slots, slot_bytes] uint8, registered with the transfer engine
        self.buf = torch.zeros((num_slots, self.slot_bytes), dtype=torch.uint8)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()  # alloc/free may come from the scheduler and a transfer thread

    @property
    def base_addr(self) -> int:
        return self.buf.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def slot_addr(self, slot: int) -> int:
        self._check(slot)
        return self.base_addr + slot * self.slot_bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, cleared, or ``None`` when all are taken."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self.buf[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        with self._lock:
            if slot in self._free:
                raise ValueError(f"aux slot {slot} freed twice")
            self._free.append(slot)

    def write(self, slot: int, aux: AuxData) -> None:
        self.buf[slot].copy_(torch.frombuffer(bytearray(self.pack(aux)), dtype=torch.uint8))

    def read(self, slot: int) -> AuxData | None:
        """The slot's aux data, or ``None`` if nothing valid was written there."""
        self._check(slot)
        return self.unpack(self.buf[slot].numpy().tobytes())

    def pack(self, aux: AuxData) -> bytes:
        n = len(aux.top_ids)
        if n != len(aux.top_logprobs) or n > self.max_top:
            raise ValueError(f"top logprobs: {n} ids, {len(aux.top_logprobs)} values, at most {self.max_top}")
        if len(aux.hidden) not in (0, self.hidden_bytes):
            raise ValueError(f"hidden state of {len(aux.hidden)} bytes for slots holding {self.hidden_bytes}")
        pad = self.max_top - n
        return (
            _HEADER.pack(_VALID, aux.token_id, aux.logprob, n, aux.cached_tokens, len(aux.hidden))
            + struct.pack(f"<{self.max_top}i", *aux.top_ids, *([0] * pad))
            + struct.pack(f"<{self.max_top}f", *aux.top_logprobs, *([0.0] * pad))
            + aux.hidden + bytes(self.hidden_bytes - len(aux.hidden))
        )

    def unpack(self, raw: bytes) -> AuxData | None:
        """The aux data in ``raw``; its hidden state only where exactly this pool's ``hidden_bytes``
        were written (a slot without room for it, or a prefill that sent none, reads as empty)."""
        valid, token_id, logprob, n, cached, n_hidden = _HEADER.unpack_from(raw)
        if valid != _VALID or n > self.max_top:
            return None
        ids = struct.unpack_from(f"<{self.max_top}i", raw, _HEADER.size)[:n]
        lps = struct.unpack_from(f"<{self.max_top}f", raw, _HEADER.size + 4 * self.max_top)[:n]
        hidden = raw[self.base_bytes : self.slot_bytes] if n_hidden and n_hidden == self.hidden_bytes else b""
        return AuxData(token_id, logprob, list(ids), list(lps), cached, bytes(hidden))

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"aux slot {slot} out of range [0, {self.num_slots})")
