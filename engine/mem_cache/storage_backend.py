"""The storage tier (L3) of the hierarchical cache: a key-value store of KV pages shared by servers.

A backend stores one object per page: every layer's K and V of one page, the
host tier's slot bytes (``HostKVPool``, page-major). Keys are namespaced
chained page hashes (``storage_key.py``), so a server reads only pages made by
a compatible one, and a key names a whole prefix.

Backends (registered by name, imported only when chosen, as the transfer
engines are): ``file`` (a local directory, one node, survives restarts) and
``mooncake`` (Mooncake Store: ``mooncake_master`` plus the memory its clients
or standalone ``mooncake_client`` processes contribute, shared by every server).

A backend's calls block (Mooncake's retry for seconds while its master is
down), so only the storage worker thread calls them (``storage_worker.py``).
Failures raise ``StorageError``; a missing object is ``None``, not an error.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from pdserve.engine.json_flags import json_object


class StorageError(RuntimeError):
    """The storage backend failed (unreachable, refused, rc != 0); the caller serves without it."""


class StorageBackend(ABC):
    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if it is not stored."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (a backend may keep an object already stored under it:
        the reader checks every object, and deletes a bad one, so the next put replaces it)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object under ``key`` (a bad one); no error if it is not stored."""

    def close(self) -> None:
        """Release connections and registered memory."""


STORAGE_BACKENDS = {
    "file": "pdserve.engine.mem_cache.file_storage:FileStorage",
    "mooncake": "pdserve.engine.mem_cache.mooncake_storage:MooncakeStorage",
}


def parse_extra_config(text: str | None) -> dict:
    """``--hicache-storage-backend-extra-config``: a JSON object (ValueError names the flag)."""
    return json_object(text, "hicache_storage_backend_extra_config")


def create_storage_backend(name: str, extra: dict) -> StorageBackend:
    module, _, attr = STORAGE_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)(extra)
