"""Typed errors of the transfer layer; raw engine integer codes become these."""

from __future__ import annotations


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


