"""Slots of registered memory for a room's aux data: the first output token and its logprobs,
and how many prompt tokens the prefill took from its cache.

Prefill writes a room's ``AuxData`` straight into the decode rank's slot with the
last KV chunk. Slot layout (little-endian): ``u32 valid, i32 token_id, f32 logprob,
u32 n_top, u32 cached_tokens, i32 top_ids[max_top], f32 top_logprobs[max_top]``.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS

_HEADER = struct.Struct("<IifII")
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


class AuxPool:
    def __init__(self, num_slots: int, max_top_logprobs: int = MAX_TOP_LOGPROBS):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.max_top = max_top_logprobs
        self.slot_bytes = _HEADER.size + 8 * max_top_logprobs
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
        pad = self.max_top - n
        return (
            _HEADER.pack(_VALID, aux.token_id, aux.logprob, n, aux.cached_tokens)
            + struct.pack(f"<{self.max_top}i", *aux.top_ids, *([0] * pad))
            + struct.pack(f"<{self.max_top}f", *aux.top_logprobs, *([0.0] * pad))
        )

    def unpack(self, raw: bytes) -> AuxData | None:
        valid, token_id, logprob, n, cached = _HEADER.unpack_from(raw)
        if valid != _VALID or n > self.max_top:
            return None
        ids = struct.unpack_from(f"<{self.max_top}i", raw, _HEADER.size)[:n]
        lps = struct.unpack_from(f"<{self.max_top}f", raw, _HEADER.size + 4 * self.max_top)[:n]
        return AuxData(token_id, logprob, list(ids), list(lps), cached)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"aux slot {slot} out of range [0, {self.num_slots})")
