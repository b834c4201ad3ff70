"""States of a KV sender or receiver (SGLang's ``KVPoll`` order)."""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def done(self) -> bool:
        return self in (KVPoll.Success, KVPoll.Failed)
