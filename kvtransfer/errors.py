"""Typed errors of the transfer layer; raw engine integer codes become these."""

from __future__ import annotations

import re


class KVTransferError(RuntimeError):
    """Base of every error this package raises."""


class TransferEngineError(KVTransferError):
    """A transfer engine call failed; keeps the backend, the operation, its code and message."""

    def __init__(self, backend: str, op: str, code: int | None, message: str):
        self.backend = backend
        self.op = op
        self.code = code
        self.message = message
        code_s = "" if code is None else f" (code {code})"
        super().__init__(f"{backend} {op} failed{code_s}: {message}")


class EngineInitError(TransferEngineError):
    """The engine could not start (bad host, no device, library missing)."""


class RegistrationError(TransferEngineError):
    """Registering or deregistering a memory region failed."""


class ConnectError(TransferEngineError):
    """The peer's info was rejected or the peer is unreachable."""


class TransferFailedError(TransferEngineError):
    """A batch write could not be submitted or completed with an error."""




# Why a room failed, as /metrics counts it (``pdserve_kv_rooms_total{cause=...}``). A room's
# failure reason is a sentence written where it failed (and passed on to the peer behind
# "aborted by prefill: " and the like); ``failure_cause`` maps it to one of these. Order matters:
# the first cause whose marker the reason (without those prefixes) contains wins.
_CAUSE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("bootstrap_timeout", ("bootstrap_timeout",)),
    ("waiting_timeout", ("waiting_timeout",)),
    ("peer_dead", ("no heartbeat reply",)),
    ("transfer", ("KV write of room", "transfer error:")),
    ("rejected", ("mismatch", "rejected this decode pool", "takes no KV heads", "unregistered decode",
                  "preallocated", "outside decode pool", "aux slot", "no such DP rank", "bootstrap lookup",
                  "DP size lookup")),
)
# prefixes a side puts in front of the reason it got from elsewhere (its peer, its loop)
_RELAY_PREFIXES = ("KV transfer failed: ", "aborted by prefill: ", "aborted by decode: ", "prefill failed: ",
                   "prefill ended the request: ")
# and the TP agreement's, in front of the reason of the rank where the room failed (tp_agreement.py)
_RELAY_RANK = re.compile(r"failed on TP rank \d+ of this server: ")
ABORTED = "aborted"  # a request ended by its client, its server or the peer's (no fault of the transfer)
OTHER = "other"
FAILURE_CAUSES = tuple(c for c, _ in _CAUSE_MARKERS) + (ABORTED, OTHER)


def failure_cause(reason: str | None) -> str:
    """The ``FAILURE_CAUSES`` entry of a failed room's reason (see ``_CAUSE_MARKERS``)."""
    text, relayed = reason or "", False
    while True:
        prefix = next((p for p in _RELAY_PREFIXES if text.startswith(p)), None)
        rank = _RELAY_RANK.match(text) if prefix is None else None
        if prefix is None and rank is None:
            break
        text, relayed = text[len(prefix) if prefix else rank.end():], True
    for cause, markers in _CAUSE_MARKERS:
        if any(m in text for m in markers):
            return cause
    # an abort that names no transfer fault: a client went away, a request ended early
    return ABORTED if relayed or text.startswith("aborted") else OTHER
