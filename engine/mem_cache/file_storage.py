"""``file`` storage backend: one file per page object in a private local folder (one node, survives restarts).

Extra config: ``{"path": DIR, "max_bytes": N}``.

- ``path``: default ``default_path()``, a folder of this user's under the system temp dir.
  The folder holds prompts' KV, so it is private: created 0700; an existing one must be a
  real directory owned by this user (else the server refuses to start, naming it); group or
  world permissions on it are removed.
- Writes go to a ``mkstemp`` file in the folder (unpredictable name, ``O_EXCL``, 0600), are
  fsynced, then renamed over the key's file, so a reader never sees half an object and a crash
  leaves the old object or the new one. A put replaces what is there: the reader deletes a bad
  object it finds, and a put never keeps one.
- ``max_bytes`` (default 0: no cap): an LRU byte cap; a put evicts the least recently used
  objects until the folder fits. Recency is the file's mtime (a get touches it), so the order
  survives restarts. Each process counts what it sees (the folder at start, its own puts and
  gets): servers sharing a folder each keep it under the cap by their view.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections import OrderedDict

from pdserve.engine.mem_cache.storage_backend import StorageBackend, StorageError

_TMP_PREFIX = ".tmp-"


def default_path() -> str:
    """A per-user folder under the system temp dir (checked like any other: owner and mode)."""
    return os.path.join(tempfile.gettempdir(), f"pdserve-hicache-{os.geteuid()}")


def private_folder(path: str) -> str:
    """Make ``path`` (mode 0700) or check it: a directory, not a link, owned by this user; group
    and world permissions are removed. StorageError names the folder and the problem."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise StorageError(f"file storage: cannot create {path}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"file storage: {path} is not a directory (a link or a file): refused")
    if st.st_uid != os.geteuid():
        raise StorageError(f"file storage: {path} is owned by uid {st.st_uid}, not this user ({os.geteuid()}): "
                           "refused (another user could read or plant KV); name a private folder in "
                           "--hicache-storage-backend-extra-config path")
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            raise StorageError(f"file storage: {path} is group/world accessible and chmod 0700 failed: "
                               f"{e.strerror}") from None
    return path


class FileStorage(StorageBackend):
    def __init__(self, extra: dict):
        self.path = private_folder(str(extra.get("path") or default_path()))
        try:
            self.max_bytes = int(extra.get("max_bytes", 0))
        except (TypeError, ValueError):
            raise StorageError(f"file storage: max_bytes must be an integer, got {extra.get('max_bytes')!r}") from None
        if self.max_bytes < 0:
            raise StorageError(f"file storage: max_bytes must be >= 0 (0: no cap), got {self.max_bytes}")
        self._sizes: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._total = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        with os.scandir(self.path) as it:
            for e in it:
                if e.name.startswith(_TMP_PREFIX) or not e.is_file(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
                found.append((st.st_mtime, e.name, st.st_size))
        for _, name, size in sorted(found):
            self._sizes[name] = size
            self._total += size

    @staticmethod
    def _name(key: str) -> str:
        return key.replace("/", "_")

    def _file(self, key: str) -> str:
        return os.path.join(self.path, self._name(key))

    @property
    def used_bytes(self) -> int:
        return self._total

    def exists(self, keys):
        return [os.path.exists(self._file(k)) for k in keys]

    def get(self, key):
        name = self._name(key)
        try:
            with open(self._file(key), "rb") as f:
                value = f.read()
            os.utime(self._file(key))  # recency for the LRU cap, also across restarts
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            raise StorageError(f"file storage: read {key}: {e}") from None
        if name in self._sizes:
            self._sizes.move_to_end(name)
        return value

    def put(self, key, value):
        name = self._name(key)
        if self.max_bytes and len(value) > self.max_bytes:
            return  # can never fit: not stored (the page stays in the upper tiers)
        self._evict(self.max_bytes - len(value) - self._sizes.get(name, 0) if self.max_bytes else None)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.path)  # O_EXCL, mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._file(key))
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"file storage: write {key}: {e}") from None
        self._forget(name)
        self._sizes[name] = len(value)
        self._total += len(value)

    def _evict(self, budget: int | None) -> None:
        """Delete least recently used objects until at most ``budget`` bytes remain (None: no cap)."""
        while budget is not None and self._total > budget and self._sizes:
            name = next(iter(self._sizes))
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageError(f"file storage: evict {name}: {e}") from None
            self._forget(name)

    def _forget(self, name: str) -> None:
        self._total -= self._sizes.pop(name, 0)

    def delete(self, key):
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"file storage: delete {key}: {e}") from None
        self._forget(self._name(key))
