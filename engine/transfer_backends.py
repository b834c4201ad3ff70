"""The KV transfer backends by name, and the check of a ``--disaggregation-transfer-backend`` value.

Light to import (no transfer library): the KV transfer config validates its backend here before any
rank starts; ``kvtransfer/engines/transfer_engine.py`` builds the chosen engine from the same table.
"""

from __future__ import annotations

import importlib

# name -> "module:Class"; imported only when chosen, so a missing library only
# breaks the backend that needs it. These names are the CLI's choices.
TRANSFER_ENGINES: dict[str, str] = {
    "mooncake": "pdserve.kvtransfer.engines.mooncake_engine:MooncakeTransferEngine",
    "nixl": "pdserve.kvtransfer.engines.nixl_engine:NixlTransferEngine",
    "local": "pdserve.kvtransfer.engines.local_engine:LocalTransferEngine",  # in one process (unit tests)
}


def is_external_spec(backend: str) -> bool:
    """A backend given as ``module:attr`` (an importable factory) rather than a registered name."""
    return ":" in backend


def check_transfer_backend(backend: str) -> None:
    """Raise ValueError unless ``backend`` is a registered name or an importable ``module:attr``
    factory ``(host, ib_device) -> TransferEngine`` (checked by importing it, so a typo fails
    before any process starts)."""
    if not is_external_spec(backend):
        if backend not in TRANSFER_ENGINES:
            raise ValueError(f"unknown transfer backend {backend!r}; choose from {sorted(TRANSFER_ENGINES)} "
                             "or give an importable 'module:attr' factory")
        return
    load_transfer_factory(backend)


def load_transfer_factory(spec: str):
    """The callable a ``module:attr`` spec names; ValueError when it cannot be imported or called."""
    module, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"transfer backend {spec!r} cannot be imported: {e}") from e
    if not callable(factory):
        raise ValueError(f"transfer backend {spec!r} is not callable")
    return factory
