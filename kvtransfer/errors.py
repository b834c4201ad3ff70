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
# prefixes a side puts in front of the reason it got from elsewhere (its peer, its loop, and the TP
# agreement's ``failed_on_rank``)
_RELAY_PREFIXES = ("KV transfer failed: ", "aborted by prefill: ", "aborted by decode: ", "prefill failed: ",
                   "prefill ended the request: ")
_RANK_PREFIX = "failed on TP rank {} of this server: "
_RELAY = re.compile("|".join(map(re.escape, _RELAY_PREFIXES)) + "|" + re.escape(_RANK_PREFIX).replace(r"\{\}", r"\d+"))
ABORTED = "aborted"  # a request ended by its client, its server or the peer's (no fault of the transfer)
OTHER = "other"
FAILURE_CAUSES = tuple(c for c, _ in _CAUSE_MARKERS) + (ABORTED, OTHER)


def failed_on_rank(tp_rank: int, reason: str) -> str:
    """A room's reason on the TP ranks it did not fail on: where it failed, and why."""
    return _RANK_PREFIX.format(tp_rank) + reason


def failure_cause(reason: str | None) -> str:
    """The ``FAILURE_CAUSES`` entry of a failed room's reason (see ``_CAUSE_MARKERS``)."""
    text, relayed = reason or "", False
    while (prefix := _RELAY.match(text)) is not None:
        text, relayed = text[prefix.end():], True
    for cause, markers in _CAUSE_MARKERS:
        if any(m in text for m in markers):
            return cause
    # an abort that names no transfer fault: a client went away, a request ended early
    return ABORTED if relayed or text.startswith("aborted") else OTHER
