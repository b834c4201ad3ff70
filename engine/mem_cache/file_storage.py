"""``file`` storage backend: one file per page object in a local directory (one node, survives restarts).

Extra config: ``{"path": DIR}`` (default ``/tmp/pdserve-hicache``). A file is
written to a temporary name and renamed, so a reader never sees half an object.
"""

from __future__ import annotations

import os

from pdserve.engine.mem_cache.storage_backend import StorageBackend, StorageError

DEFAULT_PATH = "/tmp/pdserve-hicache"


class FileStorage(StorageBackend):
    def __init__(self, extra: dict):
        self.path = str(extra.get("path", DEFAULT_PATH))
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise StorageError(f"file storage: cannot create {self.path}: {e}") from None

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.replace("/", "_"))

    def exists(self, keys):
        return [os.path.exists(self._file(k)) for k in keys]

    def get(self, key):
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"file storage: read {key}: {e}") from None

    def put(self, key, value):
        final = self._file(key)
        if os.path.exists(final):
            return
        tmp = f"{final}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, final)
        except OSError as e:
            raise StorageError(f"file storage: write {key}: {e}") from None
